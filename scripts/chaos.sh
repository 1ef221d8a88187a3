#!/usr/bin/env bash
# Fault injection for candle-tp jobs launched by tprun.
#
#   scripts/chaos.sh [--quick] [--runs N] [--debug] [--no-build] [--cases a,b,...] [--verbose]
#   scripts/chaos.sh --hosts [...]   # the faults across 2 emulated hosts x 2 ranks under
#                                    # mpirun instead: scripts/chaos-hosts.sh (its own cases)
#
# Each case starts a job under tprun, injects one fault into a random rank at a chosen phase,
# and checks that:
#   - tprun exits non-zero,
#   - within 10 s of the fault (timeout + 10 s for a stopped rank); the time from the fault to
#     tprun's exit is measured and reported,
#   - its output names the failing rank,
#   - no process of the job remains (every worker's process group is empty),
#   - nothing of the job remains in /dev/shm (candle-tp-<the job's CANDLE_TP_SHM_TAG>*).
#
# Cases (each run --runs times, default 20; --quick: 3):
#   rendezvous-kill   SIGKILL of a random rank while the ranks meet (staggered joins, 3 ranks)
#   load-kill         SIGKILL of a random rank while it maps and reads the SmolLM2 checkpoint
#                     (examples/generate, 2 ranks)
#   allreduce-kill    SIGKILL of a random rank inside an all-reduce loop (3 ranks)
#   generate-kill     SIGKILL of a random rank while rank 0 streams generated text (2 ranks)
#   pipeline-kill     the same with three pipeline stages of one rank each (generate --pp 3):
#                     a stage dies mid-step while the others wait on its activations or tokens
#   collective-stop   SIGSTOP of a random rank inside the all-reduce loop, CANDLE_TP_TIMEOUT=2
#   exit0-early       a random rank leaves the all-reduce loop and exits with code 0 (3 ranks)
#   serve-kill        SIGKILL of a random rank while candle-tp-serve (2 ranks) streams 4
#                     concurrent completions (max_tokens 200, greedy), once every stream has
#                     received a token; also checks that every client ends within 10 s of the
#                     kill with an HTTP 503, an SSE error event or a closed connection (a client
#                     still waiting, or a stream that ends without an error, fails the run)
#
# Prints a table (case, runs, passes, worst time to tear down, segments tprun had to remove;
# serve-kill also counts its clients' outcomes on stderr) and, as its last line, one JSON object:
#   {"cases", "runs", "passes", "worst_teardown_s", "leaked_segments", "leftover_processes"}
# Exit code: 0 when every run passes, 1 otherwise, 2 on bad usage or a failed build.
# The SmolLM2 checkpoint is read from ${CANDLE_TP_HOME:-~/.cache/candle-tp}/models/
# smollm2-135m-instruct (scripts/fetch-models.sh). Release binaries unless --debug; serve-kill
# also builds candle-tp-serve (--features server) and needs python3 (its clients).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
for a in "$@"; do
    [ "$a" = --hosts ] && exec "$ROOT/scripts/chaos-hosts.sh" "$@"
done
RUNS=20
PROFILE=release
BUILD=1
VERBOSE=0
ALL_CASES="rendezvous-kill,load-kill,allreduce-kill,generate-kill,pipeline-kill,collective-stop,exit0-early,serve-kill"
CASES=$ALL_CASES
STOP_TIMEOUT=2
SERVE_CLIENTS=4
SERVE_MAX_TOKENS=200

usage() { sed -n '2,39p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
# shellcheck source=scripts/lib/chaos-common.sh
. "$ROOT/scripts/lib/chaos-common.sh"
parse_args "chaos.sh" 3 "$@"

TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
BIN=$TARGET/$PROFILE
TPRUN=$BIN/tprun
WORKER=$BIN/examples/chaos_worker
GENERATE=$BIN/examples/generate
SERVE=$BIN/candle-tp-serve
MODEL=${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}/models/smollm2-135m-instruct

# serve-kill needs candle-tp-serve, built with --features server; every other case
# chaos_worker or generate.
SERVE_CASE=0; OTHER_CASES=0
for c in ${CASES//,/ }; do
    if [ "$c" = serve-kill ]; then SERVE_CASE=1; else OTHER_CASES=1; fi
done
if [ "$BUILD" = 1 ]; then
    flags=()
    [ "$PROFILE" = release ] && flags+=(--release)
    if [ "$OTHER_CASES" = 1 ]; then
        echo "chaos.sh: building tprun, chaos_worker and generate ($PROFILE)" >&2
        (cd "$ROOT" && cargo build "${flags[@]}" --bin tprun --example chaos_worker --example generate) >&2 \
            || { echo "chaos.sh: build failed" >&2; exit 2; }
    fi
    if [ "$SERVE_CASE" = 1 ]; then
        echo "chaos.sh: building candle-tp-serve and tprun with --features server ($PROFILE)" >&2
        (cd "$ROOT" && cargo build "${flags[@]}" --features server --bin candle-tp-serve --bin tprun) >&2 \
            || { echo "chaos.sh: build failed" >&2; exit 2; }
    fi
fi
needed=("$TPRUN")
[ "$OTHER_CASES" = 1 ] && needed+=("$WORKER")
for exe in "${needed[@]}"; do
    [ -x "$exe" ] || { echo "chaos.sh: $exe is missing (build it, or drop --no-build)" >&2; exit 2; }
done
case ",$CASES," in
    *,load-kill,*|*,generate-kill,*|*,pipeline-kill,*)
        [ -x "$GENERATE" ] || { echo "chaos.sh: $GENERATE is missing" >&2; exit 2; } ;;
esac
if [ "$SERVE_CASE" = 1 ]; then
    [ -x "$SERVE" ] || { echo "chaos.sh: $SERVE is missing (build it with --features server, or drop --no-build)" >&2; exit 2; }
    command -v python3 > /dev/null || { echo "chaos.sh: serve-kill needs python3 (its HTTP clients)" >&2; exit 2; }
fi
case ",$CASES," in
    *,load-kill,*|*,generate-kill,*|*,serve-kill,*)
        [ -f "$MODEL/model.safetensors" ] || {
            echo "chaos.sh: no checkpoint at $MODEL (run scripts/fetch-models.sh, or leave out load-kill, generate-kill and serve-kill with --cases)" >&2
            exit 2
        } ;;
esac

WORK=$(mktemp -d "${TMPDIR:-/tmp}/chaos.XXXXXX")
cleanup() {
    # Our own jobs only: every tprun this script started, by pid.
    for p in $(jobs -p); do kill -KILL "$p" 2>/dev/null; done
    rm -rf "$WORK"
}
trap cleanup EXIT

# serve-kill's clients (python3, standard library only): SERVE_CLIENTS concurrent streaming
# completions, one thread each. Prints "flowing" once every stream has received a token (or
# "early ..." and exits 1 if one ended before), then waits for the file DIR/killed (the kill's
# timestamp, written by one_run) and, at the latest 10 s after the kill, prints one line per
# client: "client I OUTCOME SECONDS_AFTER_KILL CHUNKS DETAIL", OUTCOME one of http_503,
# error_event (a `data: {"error": ...}` event), closed (the connection was reset or closed in
# the middle of the stream), hung (still waiting 10 s after the kill), done (`data: [DONE]`),
# ended (the response ended without [DONE] or an error), http_NNN, bad_event.
cat > "$WORK/serve_clients.py" <<'PY'
import json, os, socket, sys, threading, time

port, n, d, max_tokens = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
PROMPTS = ["Once upon a time", "The history of the Roman Empire", "Here is a recipe for bread:",
           "The three laws of thermodynamics are"]
lock = threading.Lock()
streaming, res, counts = set(), {}, [0] * n


class Closed(Exception):
    pass


def body_chunks(f, headers):
    """The response body, piece by piece; raises Closed if the connection ends before it does
    (HTTP/1.1 chunked transfer coding parsed here, so that a cut stream cannot pass for a
    finished one)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            line = f.readline()
            if not line.endswith(b"\n"):
                raise Closed("in a chunk size")
            size = int(line.split(b";")[0], 16)
            if size == 0:
                return
            data = f.read(size + 2)
            if len(data) < size + 2:
                raise Closed("in a chunk")
            yield data[:size]
    elif "content-length" in headers:
        want = int(headers["content-length"])
        data = f.read(want)
        if len(data) < want:
            raise Closed("in the body")
        yield data
    else:
        yield f.read()


def client(i):
    chunks, outcome, detail = 0, None, ""
    try:
        body = json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                           "temperature": 0, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", port), timeout=300)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        f = sock.makefile("rb")
        status = f.readline().split()
        if len(status) < 2:
            raise Closed("before the status line")
        headers = {}
        while True:
            line = f.readline()
            if not line.endswith(b"\n"):
                raise Closed("in the headers")
            if not line.strip():
                break
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if status[1] != b"200":
            outcome = "http_" + status[1].decode("latin-1")
            detail = b"".join(body_chunks(f, headers))[:300].decode(errors="replace")
        else:
            pending = b""
            for piece in body_chunks(f, headers):
                pending += piece
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if outcome is not None or not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        outcome = "done"
                        continue
                    try:
                        ev = json.loads(data)
                    except ValueError:
                        outcome, detail = "bad_event", data[:200].decode(errors="replace")
                        continue
                    if "error" in ev:
                        err = ev["error"]
                        outcome = "error_event"
                        detail = err.get("message", "") if isinstance(err, dict) else str(err)
                        continue
                    chunks += 1
                    with lock:
                        streaming.add(i)
                        counts[i] = chunks
                if outcome is not None:
                    break
            if outcome is None:
                outcome = "ended"
    except (Closed, OSError, ValueError) as e:
        if outcome is None:
            outcome, detail = "closed", "%s: %s" % (type(e).__name__, e)
    with lock:
        res[i] = (outcome, time.time(), chunks, detail)


threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
for t in threads:
    t.start()
while True:
    with lock:
        if len(streaming) == n:
            break
        if res:
            i, (outcome, _, chunks, detail) = next(iter(res.items()))
            print("early client %d %s after %d chunk(s): %s" % (i, outcome, chunks, detail), flush=True)
            sys.exit(1)
    time.sleep(0.005)
print("flowing", flush=True)
start = time.time()
while not os.path.exists(d + "/killed"):
    if time.time() - start > 120:
        sys.exit(1)
    time.sleep(0.005)
with open(d + "/killed") as f:
    fault = float(f.read())
for t in threads:
    t.join(max(0.0, fault + 10 - time.time()))
with lock:
    for i in range(n):
        outcome, end, chunks, detail = res.get(i, ("hung", None, counts[i], ""))
        after = "-" if end is None else "%.3f" % (end - fault)
        print("client %d %s %s %d %s" % (i, outcome, after, chunks, " ".join(detail.split())[:160]),
              flush=True)
os._exit(0)
PY


# Fills PIDS[rank] and TAG from tprun's children (the workers), waiting up to 30 s for them.
find_workers() {
    local n=$1 start p r
    start=$(now)
    while :; do
        PIDS=()
        for p in $(pgrep -P "$TP"); do
            r=$(tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | sed -n 's/^RANK=//p')
            [ -n "$r" ] && PIDS[r]=$p
            TAG=$(tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | sed -n 's/^CANDLE_TP_SHM_TAG=//p')
        done
        [ "${#PIDS[@]}" -eq "$n" ] && [ -n "$TAG" ] && return 0
        kill -0 "$TP" 2>/dev/null || return 1
        fle "$(fsub "$(now)" "$start")" 30 || return 1
        sleep 0.005
    done
}

# Runs one case once; sets R_OK (1/0), R_TIME (fault to tprun exit, s), R_WHY, R_LEAKED,
# R_LEFT, R_CLEANED; serve-kill also R_CLIENTS (each client's outcome) and R_CLIENT_S (the
# last client's end, s after the kill).
one_run() {
    local case=$1 dir=$2 nproc victim bound=10 fault_at="" rc t_end cl=""
    local -a cmd env=()
    R_OK=0; R_TIME=0; R_WHY=""; R_LEAKED=0; R_LEFT=0; R_CLEANED=0; R_CLIENTS=""; R_CLIENT_S=0
    mkdir -p "$dir"
    case $case in
        rendezvous-kill) nproc=3; cmd=("$WORKER" rendezvous --stagger 1 --seconds 30) ;;
        allreduce-kill) nproc=3; cmd=("$WORKER" allreduce --seconds 60) ;;
        collective-stop) nproc=3; cmd=("$WORKER" allreduce --seconds 60)
            env=("CANDLE_TP_TIMEOUT=$STOP_TIMEOUT"); bound=$((STOP_TIMEOUT + 10)) ;;
        exit0-early) nproc=3 ;;
        load-kill) nproc=2; cmd=("$GENERATE" --model "$MODEL" --max-new-tokens 8) ;;
        generate-kill) nproc=2; cmd=("$GENERATE" --model "$MODEL" --max-new-tokens 400) ;;
        pipeline-kill) nproc=3; cmd=("$GENERATE" --model "$MODEL" --max-new-tokens 400 --pp 3) ;;
        serve-kill) nproc=2; cmd=("$SERVE" --model "$MODEL" --port 0) ;;
    esac
    victim=$((RANDOM % nproc))
    [ "$case" = exit0-early ] && cmd=("$WORKER" exit0 --victim "$victim" --after "$(rand_between 0.3 1.0)" --seconds 60)
    env "${env[@]}" "$TPRUN" --standalone --nproc-per-node "$nproc" --log-dir "$dir/logs" -- "${cmd[@]}" \
        > "$dir/out" 2>&1 &
    TP=$!; WATCH_PID=$TP
    # A watchdog, so that a hung job cannot hang the script: 120 s for the whole run.
    # Its sleep is killed with it, so that no stray process holds our output open.
    ( sleep 120 & s=$!; trap 'kill $s 2>/dev/null; exit 0' TERM; wait $s; kill -KILL "$TP" 2>/dev/null ) \
        < /dev/null > /dev/null 2>&1 &
    local watchdog=$!
    if ! find_workers "$nproc"; then
        R_WHY="the workers did not start"
    else
        local vpid=${PIDS[victim]} out=$dir/out
        case $case in
            rendezvous-kill)
                # Every rank announced the rendezvous, none has joined yet: kill in that window.
                if wait_for "[ \$(grep -c 'rendezvous\$' $out) -ge $nproc ]" 20; then
                    sleep "$(rand_between 0.05 0.8)"
                    if grep -q 'joined$' "$out"; then R_WHY="missed the phase: a rank had joined"; fi
                    kill -KILL "$vpid"; fault_at=$(now)
                fi ;;
            allreduce-kill|collective-stop)
                if wait_for "[ \$(grep -c 'all-reduce loop\$' $out) -ge $nproc ]" 30; then
                    sleep "$(rand_between 0.1 0.6)"
                    if [ "$case" = collective-stop ]; then kill -STOP "$vpid"; else kill -KILL "$vpid"; fi
                    fault_at=$(now)
                fi ;;
            load-kill)
                # The victim has the checkpoint mapped: it is reading its slices.
                if wait_for "grep -q model.safetensors /proc/$vpid/maps 2>/dev/null" 30; then
                    sleep "$(rand_between 0 0.05)"
                    kill -KILL "$vpid"; fault_at=$(now)
                    if [ -s "$dir/logs/rank0.stdout" ]; then R_WHY="missed the phase: generation had started"; fi
                fi ;;
            generate-kill|pipeline-kill)
                if wait_for "[ -s $dir/logs/rank0.stdout ]" 60; then
                    sleep "$(rand_between 0.05 0.3)"
                    if grep -q tokens_per_s "$dir/logs/rank0.stdout"; then R_WHY="missed the phase: generation had ended"; fi
                    kill -KILL "$vpid"; fault_at=$(now)
                fi ;;
            exit0-early)
                wait_for "grep -q 'exits 0 early at' $out" 30 \
                    && fault_at=$(sed -n 's/.*exits 0 early at \([0-9.]*\).*/\1/p' "$out" | head -n 1) ;;
            serve-kill)
                # Rank 0 listens; the clients stream; every stream has received a token.
                local port=""
                if wait_for "grep -q '\"listening\":\"http://' $out" 60; then
                    port=$(sed -n 's/.*"listening":"http:\/\/[^"]*:\([0-9]*\)".*/\1/p' "$out" | head -n 1)
                fi
                if [ -z "$port" ]; then
                    R_WHY="the server did not listen"
                else
                    : > "$dir/clients"  # before the condition below first reads it
                    python3 -u "$WORK/serve_clients.py" "$port" "$SERVE_CLIENTS" "$dir" "$SERVE_MAX_TOKENS" \
                        < /dev/null > "$dir/clients" 2>&1 &
                    cl=$!
                    if wait_for "grep -q '^flowing' $dir/clients || ! kill -0 $cl 2>/dev/null" 60 \
                        && grep -q '^flowing' "$dir/clients"; then
                        sleep "$(rand_between 0.05 0.5)"
                        kill -KILL "$vpid"; fault_at=$(now)
                        echo "$fault_at" > "$dir/killed.tmp" && mv "$dir/killed.tmp" "$dir/killed"
                    else
                        R_WHY="the streams did not start: $(head -c 300 "$dir/clients" | tr '\n' ' ')"
                    fi
                fi ;;
        esac
        [ -z "$fault_at" ] && [ -z "$R_WHY" ] && R_WHY="the job ended before the fault could be injected"
    fi
    wait "$TP"; rc=$?
    t_end=$(now)
    kill "$watchdog" 2>/dev/null; wait "$watchdog" 2>/dev/null
    [ -n "$fault_at" ] && R_TIME=$(fsub "$t_end" "$fault_at")

    # serve-kill: every client ended within 10 s of the kill (its own deadline) with a 503, an
    # SSE error event or a closed connection. Its process is stopped if still there 12 s after.
    local client_why=""
    if [ -n "$cl" ]; then
        if [ -n "$fault_at" ]; then
            while kill -0 "$cl" 2>/dev/null && fle "$(fsub "$(now)" "$fault_at")" 12; do sleep 0.05; done
        fi
        kill -KILL "$cl" 2>/dev/null; wait "$cl" 2>/dev/null
        if [ -n "$fault_at" ]; then
            local i outcome after chunks detail nclients=0
            while read -r _ i outcome after chunks detail; do
                nclients=$((nclients + 1))
                R_CLIENTS+="${R_CLIENTS:+ }$outcome"
                [ "$after" != - ] && R_CLIENT_S=$(fmax "$R_CLIENT_S" "$after")
                if [ "$after" = - ]; then
                    log "serve-kill client $i: $outcome, $chunks chunk(s)"
                else
                    log "serve-kill client $i: $outcome ${after} s after the kill, $chunks chunk(s) ${detail}"
                fi
                [ -n "$client_why" ] && continue
                if [ "$after" != - ] && ! fle 0 "$after"; then
                    client_why="missed the phase: client $i ended before the kill ($outcome)"; continue
                fi
                case $outcome in
                    http_503|error_event|closed)
                        fle "$after" 10 || client_why="client $i ended ${after} s after the kill ($outcome)" ;;
                    hung) client_why="client $i still waiting 10 s after the kill ($chunks chunk(s))" ;;
                    done) client_why="client $i got [DONE] ${after} s after the kill, no error" ;;
                    ended) client_why="client $i: the stream ended ${after} s after the kill without [DONE] or an error" ;;
                    *) client_why="client $i: $outcome ${after} s after the kill: $detail" ;;
                esac
            done < <(grep '^client ' "$dir/clients")
            [ -z "$client_why" ] && [ "$nclients" -ne "$SERVE_CLIENTS" ] \
                && client_why="$nclients of $SERVE_CLIENTS clients reported: $(tail -c 300 "$dir/clients" | tr '\n' ' ')"
        fi
    fi

    # No process of the job: every worker and its process group gone (they are reaped by
    # init once tprun is gone; allow 2 s for that).
    local p left deadline
    deadline=$(awk -v t="$(now)" 'BEGIN { printf "%.3f", t + 2 }')
    while :; do
        left=0
        for p in "${PIDS[@]}"; do
            if kill -0 "$p" 2>/dev/null || pgrep -g "$p" > /dev/null 2>&1; then left=$((left + 1)); fi
        done
        [ "$left" -eq 0 ] && break
        fle "$(now)" "$deadline" || break
        sleep 0.05
    done
    R_LEFT=$left
    if [ "$left" -gt 0 ]; then
        for p in "${PIDS[@]}"; do kill -KILL -- "-$p" 2>/dev/null; kill -CONT "$p" 2>/dev/null; done
    fi
    if [ -n "$TAG" ]; then
        R_LEAKED=$(find /dev/shm -maxdepth 1 -name "candle-tp-$TAG*" 2>/dev/null | wc -l)
        find /dev/shm -maxdepth 1 -name "candle-tp-$TAG*" -delete 2>/dev/null
    fi
    R_CLEANED=$(sed -n 's/^tprun: removed \([0-9]*\) shared-memory segment.*/\1/p' "$dir/out" | head -n 1)
    R_CLEANED=${R_CLEANED:-0}

    # The output names the failing rank: tprun's report, or a survivor's error about it.
    local named=0
    if grep -Eq "tprun: rank $victim \(pid [0-9]+\) failed first|peer rank $victim \(pid" "$dir/out"; then
        named=1
    elif grep -Eq "for rank\(s\) ([0-9]+, )*$victim(, [0-9]+)* that never arrived" "$dir/out"; then
        named=1
    fi

    if [ -z "$R_WHY" ]; then
        if [ "$rc" -eq 0 ]; then R_WHY="tprun exited 0"
        elif ! fle "$R_TIME" "$bound"; then R_WHY="teardown took ${R_TIME} s (bound ${bound} s)"
        elif [ "$named" = 0 ]; then R_WHY="the output does not name rank $victim"
        elif [ "$R_LEFT" -gt 0 ]; then R_WHY="$R_LEFT process(es) of the job left"
        elif [ "$R_LEAKED" -gt 0 ]; then R_WHY="$R_LEAKED segment(s) left in /dev/shm"
        elif [ -n "$client_why" ]; then R_WHY=$client_why
        else R_OK=1
        fi
    fi
    log "$case: victim rank $victim, rc $rc, fault->exit ${R_TIME} s, cleaned $R_CLEANED,${R_CLIENTS:+ clients: $R_CLIENTS (last ${R_CLIENT_S} s after the kill),} ${R_WHY:-ok}"
    if [ "$R_OK" = 0 ]; then
        echo "chaos.sh: $case run failed: $R_WHY (victim rank $victim, rc $rc); tprun output:" >&2
        tail -n 15 "$dir/out" | sed 's/^/    /' >&2
        if [ -s "$dir/clients" ]; then
            echo "  the clients (client I OUTCOME S_AFTER_KILL CHUNKS DETAIL):" >&2
            cut -c 1-200 "$dir/clients" | sed 's/^/    /' >&2
        fi
    fi
}

total_runs=0; total_passes=0; worst_all=0; leaked_all=0; left_all=0; ncases=0
rows=()
for case in ${CASES//,/ }; do
    passes=0; worst=0; cleaned=0; clients=""; client_worst=0
    for ((i = 1; i <= RUNS; i++)); do
        one_run "$case" "$WORK/$case.$i"
        passes=$((passes + R_OK))
        worst=$(fmax "$worst" "$R_TIME")
        clients+="${clients:+ }$R_CLIENTS"
        client_worst=$(fmax "$client_worst" "$R_CLIENT_S")
        cleaned=$((cleaned + R_CLEANED))
        leaked_all=$((leaked_all + R_LEAKED))
        left_all=$((left_all + R_LEFT))
        rm -rf "$WORK/$case.$i"
    done
    ncases=$((ncases + 1))
    total_runs=$((total_runs + RUNS)); total_passes=$((total_passes + passes))
    worst_all=$(fmax "$worst_all" "$worst")
    rows+=("$(printf '%-16s %5d %7d %19s %17d' "$case" "$RUNS" "$passes" "$worst" "$cleaned")")
    echo "chaos.sh: $case: $passes/$RUNS passed, worst teardown $worst s" >&2
    if [ -n "$clients" ]; then
        echo "chaos.sh: $case clients: $(echo "$clients" | tr ' ' '\n' | sort | uniq -c | awk '{ printf "%s%s %d", (NR > 1 ? ", " : ""), $2, $1 }'); the last ended $client_worst s after the kill" >&2
    fi
done

echo "binaries: $PROFILE ($BIN)"
printf '%-16s %5s %7s %19s %17s\n' case runs passes worst_teardown_s tprun_removed_shm
for row in "${rows[@]}"; do echo "$row"; done
printf '{"cases": %d, "runs": %d, "passes": %d, "worst_teardown_s": %s, "leaked_segments": %d, "leftover_processes": %d}\n' \
    "$ncases" "$total_runs" "$total_passes" "$worst_all" "$leaked_all" "$left_all"
[ "$total_passes" -eq "$total_runs" ]
