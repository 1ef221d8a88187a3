//! Requests that are valid JSON but hostile must fail alone (issue 44, defects 10 and 11): the
//! scheduler (rank 0's loop, in this process, on SmolLM2) keeps serving the requests around
//! them, with the ids those requests get alone. Needs `--features server` and
//! `scripts/fetch-models.sh`.
//!
//! - A temperature of 1e-308 (inside OpenAI's [0, 2]) with a bias of -100 on every id scaled
//!   the logits to -inf in f64 and failed the whole step, ending every request; it now draws
//!   greedily (temperatures below `GREEDY_BELOW`, as vLLM), and since the bias shifts every
//!   logit alike, its tokens are the greedy ones.
//! - Sampling parameters that only a library caller of the queue can send (a NaN temperature,
//!   top-k 0) end that request with an error naming the parameter, checked before it joins the
//!   batch, instead of failing the step.
//! - A request's choices are queued all or none: a request with more choices than the queue
//!   has room for is refused whole and leaves nothing queued.
#![cfg(feature = "server")]

use std::time::Duration;

use candle_core::{DType, Device};
use candle_tp::generate::{
    BatchDecoder, FinishReason, Penalties, SamplingParams, SeqOptions, SeqRequest,
};
use candle_tp::models::CausalLm;
use candle_tp::serve::{self, Event, Submission, SubmitError};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

mod common;

use common::serve::{alone, collect, model_dir};

fn request(prompt: &[u32], max_tokens: usize, params: SamplingParams) -> SeqRequest {
    SeqRequest {
        id: 0,
        prompt: prompt.to_vec(),
        max_tokens,
        min_tokens: 0,
        params,
        stop_ids: Vec::new(),
        options: SeqOptions::default(),
    }
}

fn submission(seq: SeqRequest) -> (Submission, UnboundedReceiver<Event>) {
    let (tx, rx) = unbounded_channel();
    let s = Submission {
        seq,
        filter: None,
        events: tx,
    };
    (s, rx)
}

/// A tiny temperature with every id biased by -100, a NaN temperature and top-k 0, submitted
/// between two ordinary greedy requests: the loop runs until it is shut down (no failed step),
/// the ordinary requests get their ids alone, the tiny temperature gets the greedy ids and the
/// invalid parameters end their own requests with errors naming them.
#[test]
fn hostile_sampling_parameters_fail_alone() {
    const MAX_NEW: usize = 6;
    candle_tp::set_batch_invariant_matmul(true);
    let mut model = CausalLm::from_path(
        model_dir(),
        DType::F32,
        &Device::Cpu,
        candle_tp::ProcessGroup::single(),
    )
    .expect("model");
    let vocab = model.config().vocab_size as u32;
    let first: Vec<u32> = vec![504, 3575, 282, 4649, 314];
    let second: Vec<u32> = vec![1, 3, 9, 27, 81, 243];
    let want_first = alone(&mut model, &first, MAX_NEW);
    let want_second = alone(&mut model, &second, MAX_NEW);

    let mut tiny = request(
        &first,
        MAX_NEW,
        SamplingParams {
            temperature: 1e-308,
            top_k: None,
            top_p: None,
            seed: 7,
        },
    );
    tiny.options.penalties = Penalties {
        logit_bias: (0..vocab).map(|id| (id, -100.0)).collect(),
        ..Penalties::default()
    };
    let mut tiny_top_p = tiny.clone();
    tiny_top_p.params.top_p = Some(0.9);
    let nan = request(
        &second,
        MAX_NEW,
        SamplingParams {
            temperature: f64::NAN,
            ..SamplingParams::greedy()
        },
    );
    let top_k_0 = request(
        &second,
        MAX_NEW,
        SamplingParams {
            temperature: 1.0,
            top_k: Some(0),
            top_p: None,
            seed: 1,
        },
    );

    let mut dec = BatchDecoder::new(8, 2048, 16).expect("decoder");
    let (queue, inbox) = serve::queue(16);
    let mut rxs = Vec::new();
    for seq in [
        request(&first, MAX_NEW, SamplingParams::greedy()),
        tiny,
        nan,
        tiny_top_p,
        top_k_0,
        request(&second, MAX_NEW, SamplingParams::greedy()),
    ] {
        let (s, rx) = submission(seq);
        queue.submit(s).expect("queued");
        rxs.push(rx);
    }
    let client = {
        let queue = queue.clone();
        std::thread::spawn(move || {
            let got: Vec<_> = rxs.into_iter().map(collect).collect();
            queue.shutdown();
            got
        })
    };
    serve::run_leader(&mut model, &mut dec, inbox, Duration::from_millis(200))
        .expect("the loop ends by the shutdown, not by a failed step");
    let got = client.join().expect("client");
    let [ok_first, tiny, nan, tiny_top_p, top_k_0, ok_second] = &got[..] else {
        panic!("{got:?}")
    };
    assert_eq!(*ok_first, (want_first.clone(), Ok(FinishReason::Length)));
    assert_eq!(*ok_second, (want_second, Ok(FinishReason::Length)));
    // The same bias on every id moves no logit relative to another: the greedy ids.
    assert_eq!(*tiny, (want_first.clone(), Ok(FinishReason::Length)));
    assert_eq!(*tiny_top_p, (want_first, Ok(FinishReason::Length)));
    let msg = nan.1.as_ref().expect_err("a NaN temperature");
    assert!(nan.0.is_empty() && msg.contains("temperature"), "{nan:?}");
    let msg = top_k_0.1.as_ref().expect_err("top_k = 0");
    assert!(top_k_0.0.is_empty() && msg.contains("top_k"), "{top_k_0:?}");
}

/// A request's choices are queued all or none: with 3 of 4 places taken, two choices are
/// refused together (nothing of them is queued, the waiting count stays 3), one still fits,
/// and once the loop has taken the waiting requests there is room for two again.
#[test]
fn choices_are_queued_all_or_none() {
    let (queue, _inbox) = serve::queue(4);
    let greedy = || request(&[1, 2, 3], 1, SamplingParams::greedy());
    let mut kept = Vec::new();
    for _ in 0..3 {
        let (s, rx) = submission(greedy());
        queue.submit(s).expect("room");
        kept.push(rx);
    }
    let waiting = || {
        queue
            .metrics()
            .waiting
            .load(std::sync::atomic::Ordering::SeqCst)
    };
    assert_eq!(waiting(), 3);
    let (a, _ra) = submission(greedy());
    let (b, _rb) = submission(greedy());
    assert_eq!(queue.submit_all(vec![a, b]), Err(SubmitError::Full));
    assert_eq!(waiting(), 3, "a refused request leaves nothing queued");
    let (c, _rc) = submission(greedy());
    assert_eq!(queue.submit_all(vec![c]), Ok(()));
    assert_eq!(waiting(), 4);
    let (d, _rd) = submission(greedy());
    assert_eq!(queue.submit(d), Err(SubmitError::Full));
    assert_eq!(waiting(), 4);
}

/// Issue 44, defect 17: `--pp 1 --pp-layers 30` (one stage, SmolLM2's 30 layers) left grammars
/// on while the decoder refused them on any pipeline, so a constrained request failed the
/// plan on every rank. Now it is a 400 naming `response_format`, and the server goes on.
#[test]
fn grammars_are_refused_on_a_single_stage_pipeline_and_the_server_goes_on() {
    use common::serve::{is_running, post, Server, SERIAL};
    use serde_json::json;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(
        2,
        &["--pp", "1", "--pp-layers", "30", "--max-seq-len", "64"],
    );
    let pids = server.rank_pids();
    let (status, v) = post(
        server.port,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Say hi in JSON"}],
                "response_format": {"type": "json_object"}, "max_tokens": 4}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "response_format", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("pipeline")),
        "{v}"
    );
    let (status, v) = post(
        server.port,
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    for (rank, pid) in pids {
        assert!(is_running(pid), "rank {rank} is gone");
    }
}
