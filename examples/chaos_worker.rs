//! A worker for fault injection (`scripts/chaos.sh`, `tests/chaos.rs`): it joins the job,
//! announces each phase on stderr (`chaos: rank R <phase>`), and loops on all-reduces so that a
//! fault injected from outside lands where the script wants it.
//!
//! ```text
//! tprun --standalone --nproc-per-node 3 target/release/examples/chaos_worker allreduce --seconds 30
//! ```
//!
//! Modes:
//! - `rendezvous --stagger S`: rank R waits R × S seconds before joining, so that the others sit
//!   in the rendezvous meanwhile; then it runs the all-reduce loop.
//! - `allreduce`: the all-reduce loop, for `--seconds` (rank 0 decides when to stop and tells the
//!   others through the reduced buffer, so every rank runs the same number of collectives).
//! - `exit0 --victim K --after S`: the all-reduce loop, but rank K prints
//!   `chaos: rank K exits 0 early at <unix seconds>` and exits with code 0 after S seconds.
//! - `group --stagger S`: every rank joins the job, then makes a sub-group of every rank
//!   (`chaos: rank R group rendezvous`), rank R R × S seconds late, so that the others sit in
//!   the sub-group's rendezvous (its shared memory created, not yet mapped by every rank);
//!   then (`chaos: rank R group joined`) it runs the all-reduce loop on the sub-group.
//! - `pipeline`: the ranks hand a buffer on around a ring with point-to-point sends and
//!   receives (rank 0 to 1, ..., the last back to 0), as pipeline stages hand on activations,
//!   for `--seconds`.
//! - `error --victim K --phase P`: rank K returns an error from `main` (exit status 1) at
//!   phase P: `init` (before it joins), `join` (inside the join: its shared-memory slots are
//!   set twice as large as its peers', so it cannot map the region they made), `token` (inside
//!   the join: it presents a wrong token to the rendezvous store, through the
//!   `CANDLE_TP_FAULT_WRONG_TOKEN` hook), `loop` (after `--after` seconds of the all-reduce
//!   loop, its peers inside an all-reduce), `handoff` (after `--after` seconds of the
//!   `pipeline` ring: it receives its buffer and fails instead of handing it on, its successor
//!   waiting to receive) or `end` (after the loop, when every rank is done). It prints
//!   `chaos: rank K returns an error (P) at <unix seconds>` first; for `join` and `token`,
//!   where the error comes from the library, that line marks when the join starts.
//!
//! Rank 0 ends with one JSON line: `iterations`, `world_size`, `start` and `end` (Unix seconds
//! of the loop). With `--check`, each all-reduce result is compared with the value every rank can compute
//! (the sum of the ranks' contributions) and a difference is an error.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Result};
use candle_core::Device;
use candle_tp::comm::ReduceOp;
use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Rendezvous,
    Allreduce,
    Exit0,
    Error,
    Group,
    Pipeline,
}

/// Where `error` makes its victim fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Phase {
    Init,
    Join,
    Token,
    Loop,
    Handoff,
    End,
}

#[derive(Parser, Debug)]
#[command(about = "Fault-injection worker: joins the job and loops on all-reduces")]
struct Args {
    /// What to do.
    #[arg(value_enum)]
    mode: Mode,
    /// How long the all-reduce loop runs, in seconds.
    #[arg(long, default_value_t = 30.0)]
    seconds: f64,
    /// f32 elements per all-reduce.
    #[arg(long, default_value_t = 65_536)]
    elems: usize,
    /// `rendezvous`, `group`: rank R waits R × this many seconds before joining.
    #[arg(long, default_value_t = 0.5)]
    stagger: f64,
    /// `exit0`: the rank that exits early.
    #[arg(long, default_value_t = 1)]
    victim: usize,
    /// `exit0`, `error --phase loop` or `handoff`: seconds after joining at which the victim
    /// leaves.
    #[arg(long, default_value_t = 0.5)]
    after: f64,
    /// `error`: when the victim returns its error.
    #[arg(long, value_enum, default_value_t = Phase::Loop)]
    phase: Phase,
    /// Check every all-reduce result against the expected sum.
    #[arg(long)]
    check: bool,
}

/// Seconds since the Unix epoch, for the fault timestamps the chaos script reads.
fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A duration from a number of seconds given on the command line.
fn seconds(name: &str, value: f64) -> Result<Duration> {
    match Duration::try_from_secs_f64(value) {
        Ok(d) => Ok(d),
        Err(e) => bail!("--{name} {value}: {e}"),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    // RANK under tprun and torchrun, the MPI launcher's own variables under mpirun and srun.
    let rank = candle_tp::comm::launch_from_env()?.rank;
    let fail = |phase: Phase| -> Result<()> {
        if args.mode == Mode::Error && args.phase == phase && rank == args.victim {
            // One write, so that mpirun's output tags do not cut the line.
            let line = format!(
                "chaos: rank {rank} returns an error ({phase:?}) at {:.6}\n",
                unix_now()
            );
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            bail!("rank {rank}: the injected error ({phase:?})");
        }
        Ok(())
    };
    let victim = args.mode == Mode::Error && rank == args.victim;
    fail(Phase::Init)?;
    if victim && matches!(args.phase, Phase::Join | Phase::Token) {
        let line = format!(
            "chaos: rank {rank} returns an error ({:?}) at {:.6}\n",
            args.phase,
            unix_now()
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        if args.phase == Phase::Join {
            // Twice the default slot size (4 MiB): the region its peers make is too small.
            std::env::set_var("CANDLE_TP_SLOT_BYTES", (8usize << 20).to_string());
        } else {
            std::env::set_var(candle_tp::comm::FAULT_WRONG_TOKEN_VAR, "1");
        }
    }
    if args.mode == Mode::Rendezvous {
        eprintln!("chaos: rank {rank} rendezvous");
        std::thread::sleep(seconds("stagger", args.stagger * rank as f64)?);
    }
    let world = candle_tp::init_from_env(&Device::Cpu)?;
    if matches!(args.mode, Mode::Exit0 | Mode::Error) && args.victim >= world.size() {
        bail!(
            "--victim {} is not a rank of this job of {}",
            args.victim,
            world.size()
        );
    }
    eprintln!("chaos: rank {rank} joined");
    let pg = if args.mode == Mode::Group {
        eprintln!("chaos: rank {rank} group rendezvous");
        std::thread::sleep(seconds("stagger", args.stagger * rank as f64)?);
        let all: Vec<usize> = (0..world.size()).collect();
        let g = world
            .new_group_named(&all, "chaos")?
            .expect("every rank is a member");
        eprintln!("chaos: rank {rank} group joined");
        g
    } else {
        world
    };
    let run_for = seconds("seconds", args.seconds)?;
    let exit_after = seconds("after", args.after)?;
    let start = Instant::now();
    let started_at = unix_now();
    let mut buf = vec![0f32; args.elems.max(2)];
    let world = pg.size() as f32;
    let mut iterations = 0u64;
    if args.mode == Mode::Pipeline || (args.mode == Mode::Error && args.phase == Phase::Handoff) {
        let (size, next) = (pg.size(), (rank + 1) % pg.size());
        let prev = (rank + size - 1) % size;
        eprintln!("chaos: rank {rank} pipeline loop");
        loop {
            // Rank 0 starts each round (and decides when to stop); the others receive, add
            // their part and hand it on.
            if rank == 0 {
                buf[0] = if start.elapsed() >= run_for { 1.0 } else { 0.0 };
                buf[1] = 0.0;
                pg.send_slice(&buf, next)?;
                pg.recv_slice(&mut buf, prev)?;
            } else {
                pg.recv_slice(&mut buf, prev)?;
                if args.phase == Phase::Handoff && start.elapsed() >= exit_after {
                    fail(Phase::Handoff)?;
                }
                buf[1] += rank as f32;
                pg.send_slice(&buf, next)?;
            }
            iterations += 1;
            let want = (size * (size - 1) / 2) as f32;
            if args.check && rank == 0 && buf[1] != want {
                bail!("rank 0: the ring brought back {}, expected {want}", buf[1]);
            }
            if buf[0] > 0.0 {
                break;
            }
        }
        eprintln!("chaos: rank {rank} done after {iterations} hand-offs");
        return finish(rank, &pg, iterations, started_at);
    }
    eprintln!("chaos: rank {rank} all-reduce loop");
    loop {
        if args.mode == Mode::Exit0 && rank == args.victim && start.elapsed() >= exit_after {
            eprintln!("chaos: rank {rank} exits 0 early at {:.6}", unix_now());
            return Ok(());
        }
        if args.phase == Phase::Loop && start.elapsed() >= exit_after {
            fail(Phase::Loop)?;
        }
        let stop = rank == 0 && start.elapsed() >= run_for;
        buf[0] = if stop { 1.0 } else { 0.0 };
        for (i, x) in buf.iter_mut().enumerate().skip(1) {
            *x = (rank + i % 7) as f32;
        }
        pg.all_reduce_slice(&mut buf, ReduceOp::Sum)?;
        iterations += 1;
        if args.check {
            // Sum over ranks r of (r + i % 7) = world (world - 1) / 2 + world (i % 7).
            for (i, x) in buf.iter().enumerate().skip(1) {
                let want = world * (world - 1.0) / 2.0 + world * (i % 7) as f32;
                if *x != want {
                    bail!("rank {rank}: all-reduce element {i} is {x}, expected {want}");
                }
            }
        }
        if buf[0] > 0.0 {
            break;
        }
    }
    eprintln!("chaos: rank {rank} done after {iterations} all-reduces");
    fail(Phase::End)?;
    finish(rank, &pg, iterations, started_at)
}

/// Rank 0's closing JSON line.
fn finish(
    rank: usize,
    pg: &candle_tp::comm::ProcessGroup,
    iterations: u64,
    started_at: f64,
) -> Result<()> {
    if rank == 0 {
        println!(
            "{{\"iterations\": {iterations}, \"world_size\": {}, \"start\": {started_at:.6}, \"end\": {:.6}}}",
            pg.size(),
            unix_now()
        );
    }
    Ok(())
}
