//! The crate's structure, checked from its `use` lines (issue 46): data flows one way down.
//!
//! - No circle among the files of `src/` or `kernels/src/`: no file imports, directly or
//!   through others, a file that imports it.
//! - The rooms (top-level modules) in [`ROOMS`], bottom first: a room imports only rooms on
//!   lower levels.
//! - `comm`'s layers in [`COMM_LAYERS`], bottom first: a file imports only its own layer or
//!   the layers below.
//!
//! docs/ARCHITECTURE.md draws the same tables; a change to one is a change to both. The
//! checker itself is tested on made-up sources below, so that each rule is seen to fail.

mod imports;

use std::collections::BTreeMap;
use std::path::Path;

use imports::{name, Crate, Edge, Module};

/// The rooms of `src/`, bottom level first. A room may import only rooms on lower levels.
const ROOMS: &[&[&str]] = &[
    // Leaves: the split of a dimension, seeded randomness, memory probes, the thread pool,
    // chat templates.
    &["partition", "rng", "memory", "pool", "chat_template"],
    // Process groups, collectives and their backends.
    &["comm"],
    // Devices by rank; the GGUF container.
    &["device", "gguf"],
    // Quantized weights and their products.
    &["quant"],
    // Collectives and point-to-point as Candle ops with autograd.
    &["ops"],
    // A rank's place in a pipeline of stages.
    &["stage"],
    // Checkpoint readers and the sharded VarBuilder.
    &["loader"],
    // The parallel layers.
    &["nn"],
    // Training: the trainable decoder, dropout, gradients.
    &["train"],
    // Model families.
    &["models"],
    // Pipeline schedules and training steps; generation and batched decoding.
    &["pipeline", "generate"],
    // Tokenizers and streaming text; checkpoint conversion.
    &["text", "convert"],
    // The OpenAI-compatible server.
    &["serve"],
];

/// `comm`'s layers, bottom first: a file imports its own layer or those below.
const COMM_LAYERS: &[(&str, &[&str])] = &[
    (
        "types: errors, element types, statistics, the job's layout, the rendezvous, all-to-all block sizes, the job token file, secrets",
        &["error", "element", "stats", "launcher", "rendezvous", "block_sizes", "job_token", "secret"],
    ),
    ("the store, over its own transport", &["store"]),
    (
        "engines: waits, mapped regions, the shm engine",
        &["wait", "region", "engine"],
    ),
    (
        "the Backend trait and what a job's groups share",
        &["context", "backend"],
    ),
    (
        "backends, each over the trait",
        &["single", "shm", "mpi", "nccl", "hierarchical"],
    ),
    (
        "ProcessGroup, its all-to-all and point-to-point, meshes",
        &["group", "all_to_all", "p2p", "mesh"],
    ),
    (
        "joining a job, the threads runner, the choice from the environment",
        &["join", "threads", "env"],
    ),
];

fn level_of(table: &[&[&str]], room: &str) -> Option<usize> {
    table.iter().position(|l| l.contains(&room))
}

fn describe(c: &Crate, e: &Edge) -> String {
    format!(
        "{} ({}:{}) imports {}",
        name(&e.from),
        c.files.get(&e.from).map_or("?", String::as_str),
        e.line,
        name(&e.to)
    )
}

/// The circles, each with the edges inside it, as text.
fn circles(c: &Crate) -> Vec<String> {
    let edges = c.edges();
    c.circles()
        .into_iter()
        .map(|comp| {
            let inside: Vec<String> = edges
                .iter()
                .filter(|e| comp.contains(&e.from) && comp.contains(&e.to))
                .map(|e| format!("    {}", describe(c, e)))
                .collect();
            let names: Vec<String> = comp.iter().map(name).collect();
            format!("circle of {}:\n{}", names.join(", "), inside.join("\n"))
        })
        .collect()
}

/// Imports of a room from a room on the same or a higher level, and rooms missing from the
/// table.
fn upward_rooms(c: &Crate, rooms: &[&[&str]]) -> Vec<String> {
    let mut bad = Vec::new();
    for m in c.files.keys().filter(|m| !m.is_empty()) {
        if level_of(rooms, &m[0]).is_none() {
            bad.push(format!(
                "room '{}' ({}) is not in the table of rooms",
                m[0], c.files[m]
            ));
        }
    }
    for e in c.edges() {
        let (Some(a), Some(b)) = (e.from.first(), e.to.first()) else {
            continue; // lib.rs: the crate's facade
        };
        if a == b {
            continue;
        }
        match (level_of(rooms, a), level_of(rooms, b)) {
            (Some(la), Some(lb)) if lb >= la => bad.push(format!(
                "{}: room '{a}' (level {la}) may not import room '{b}' (level {lb})",
                describe(c, &e)
            )),
            _ => {}
        }
    }
    bad.sort();
    bad.dedup();
    bad
}

/// Imports inside `room` that go up its table of layers, and files missing from it.
fn upward_layers(c: &Crate, room: &str, layers: &[(&str, &[&str])]) -> Vec<String> {
    let table: Vec<&[&str]> = layers.iter().map(|(_, l)| *l).collect();
    let layer = |m: &Module| -> Option<Option<usize>> {
        (m.first().map(String::as_str) == Some(room) && m.len() > 1)
            .then(|| level_of(&table, &m[1]))
    };
    let mut bad = Vec::new();
    for m in c.files.keys() {
        if layer(m) == Some(None) {
            bad.push(format!(
                "{} ({}) is in no layer of '{room}'",
                name(m),
                c.files[m]
            ));
        }
    }
    for e in c.edges() {
        if let (Some(Some(la)), Some(Some(lb))) = (layer(&e.from), layer(&e.to)) {
            if lb > la {
                bad.push(format!(
                    "{}: layer '{}' may not import layer '{}'",
                    describe(c, &e),
                    layers[la].0,
                    layers[lb].0
                ));
            }
        }
    }
    bad.sort();
    bad.dedup();
    bad
}

fn crate_at(dir: &str) -> Crate {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    Crate::parse(&imports::read_dir(&src))
}

/// Fails on any circle among the files under `dir`, after checking it read at least `min`.
fn assert_no_circles(dir: &str, min: usize) {
    let c = crate_at(dir);
    assert!(c.files.len() > min, "read {} files", c.files.len());
    let found = circles(&c);
    assert!(
        found.is_empty(),
        "import circles in {dir}/:\n{}",
        found.join("\n")
    );
}

#[test]
fn no_file_of_src_imports_itself_through_others() {
    assert_no_circles("src", 100);
}

#[test]
fn no_file_of_the_kernels_imports_itself_through_others() {
    assert_no_circles("kernels/src", 20);
}

#[test]
fn rooms_import_only_rooms_below_them() {
    let bad = upward_rooms(&crate_at("src"), ROOMS);
    assert!(
        bad.is_empty(),
        "upward imports between rooms:\n{}",
        bad.join("\n")
    );
}

#[test]
fn comm_layers_import_only_layers_below_them() {
    let c = crate_at("src");
    let bad = upward_layers(&c, "comm", COMM_LAYERS);
    assert!(
        bad.is_empty(),
        "upward imports in comm:\n{}",
        bad.join("\n")
    );
    // The table covers what it should: every backend file is in the backends' layer.
    assert!(c.files.keys().any(|m| name(m) == "comm::shm"));
}

/// The checker on made-up crates: each rule finds what it is meant to, so that a passing run
/// above means something.
mod checker {
    use super::*;

    fn parse(files: &[(&str, &str)]) -> Crate {
        let map: BTreeMap<String, String> = files
            .iter()
            .map(|(p, s)| (p.to_string(), s.to_string()))
            .collect();
        Crate::parse(&map)
    }

    fn edge_names(c: &Crate) -> Vec<String> {
        let mut v: Vec<String> = c
            .edges()
            .iter()
            .map(|e| format!("{} -> {}", name(&e.from), name(&e.to)))
            .collect();
        v.dedup();
        v
    }

    #[test]
    fn resolves_through_a_facade_to_the_defining_file() {
        let c = parse(&[
            ("lib.rs", "pub mod a;\npub mod b;\npub use a::Thing;"),
            ("a/mod.rs", "mod inner;\npub use inner::Thing;"),
            ("a/inner.rs", "pub struct Thing;"),
            (
                "b.rs",
                "use crate::Thing;\nfn f() -> crate::a::Thing { todo!() }",
            ),
        ]);
        assert_eq!(edge_names(&c), vec!["b -> a::inner"]);
    }

    #[test]
    fn sees_use_lines_inline_paths_super_and_child_modules() {
        let c = parse(&[
            ("lib.rs", "pub mod a;"),
            ("a/mod.rs", "mod x;\nmod y;\nmod z;\nuse x::X;\npub(crate) struct Top;"),
            ("a/x.rs", "pub struct X;"),
            ("a/y.rs", "fn f() { let _ = super::Top; }"),
            ("a/z.rs", "// use super::y::Nothing;\nconst S: &str = \"crate::a::y\";\nuse self::q::{R, S as T};"),
        ]);
        assert_eq!(edge_names(&c), vec!["a -> a::x", "a::y -> a"]);
    }

    #[test]
    fn an_inline_test_module_is_part_of_its_file() {
        let c = parse(&[
            ("lib.rs", "pub mod a;\npub mod b;"),
            ("a.rs", "pub fn f() {}\n#[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::b::g;\n}"),
            ("b.rs", "pub fn g() {}"),
        ]);
        assert_eq!(edge_names(&c), vec!["a -> b"]);
    }

    #[test]
    fn finds_a_circle_and_names_its_lines() {
        let c = parse(&[
            ("lib.rs", "pub mod a;\npub mod b;\npub mod c;"),
            ("a.rs", "use crate::b::B;\npub struct A;"),
            ("b.rs", "\n\nuse crate::c::C;\npub struct B;"),
            ("c.rs", "pub struct C(crate::a::A);"),
        ]);
        let found = circles(&c);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("circle of a, b, c"), "{}", found[0]);
        assert!(found[0].contains("b (b.rs:3) imports c"), "{}", found[0]);
    }

    #[test]
    fn a_facade_reexport_is_no_circle_but_a_parent_definition_is() {
        let facade = parse(&[
            ("lib.rs", "pub mod a;"),
            ("a/mod.rs", "mod x;\nmod y;\npub use x::X;\npub use y::Y;"),
            ("a/x.rs", "pub struct X;"),
            ("a/y.rs", "use super::X;\npub struct Y;"),
        ]);
        assert!(circles(&facade).is_empty(), "{:?}", circles(&facade));
        let parent = parse(&[
            ("lib.rs", "pub mod a;"),
            ("a/mod.rs", "mod x;\npub struct Shared;\nfn f() { x::g(); }"),
            ("a/x.rs", "use super::Shared;\npub fn g() {}"),
        ]);
        assert_eq!(circles(&parent).len(), 1);
    }

    #[test]
    fn an_upward_room_import_fails_and_a_downward_one_passes() {
        let rooms: &[&[&str]] = &[&["low"], &["high"]];
        let c = parse(&[
            ("lib.rs", "pub mod low;\npub mod high;"),
            ("low.rs", "use crate::high::H;\npub struct L;"),
            ("high.rs", "pub struct H;"),
        ]);
        let bad = upward_rooms(&c, rooms);
        assert_eq!(bad.len(), 1, "{bad:?}");
        assert!(bad[0].contains("room 'low' (level 0) may not import room 'high'"));
        let ok = parse(&[
            ("lib.rs", "pub mod low;\npub mod high;"),
            ("low.rs", "pub struct L;"),
            ("high.rs", "use crate::low::L;"),
        ]);
        assert!(upward_rooms(&ok, rooms).is_empty());
        let unknown = parse(&[("lib.rs", "pub mod other;"), ("other.rs", "")]);
        assert!(upward_rooms(&unknown, rooms)[0].contains("not in the table"));
    }

    #[test]
    fn an_upward_layer_import_fails() {
        let layers: &[(&str, &[&str])] = &[("bottom", &["x"]), ("top", &["y"])];
        let c = parse(&[
            ("lib.rs", "pub mod r;"),
            ("r/mod.rs", "mod x;\nmod y;\nmod z;"),
            ("r/x.rs", "use super::y::Y;"),
            ("r/y.rs", "pub struct Y;"),
            ("r/z.rs", ""),
        ]);
        let bad = upward_layers(&c, "r", layers);
        assert_eq!(bad.len(), 2, "{bad:?}");
        assert!(bad
            .iter()
            .any(|b| b.contains("layer 'bottom' may not import layer 'top'")));
        assert!(bad
            .iter()
            .any(|b| b.contains("r::z (r/z.rs) is in no layer")));
    }

    #[test]
    fn blanks_comments_strings_and_chars_but_keeps_lines() {
        let src = "let a = '\"'; // crate::x\nlet b = \"crate::y\"; /* crate::z\n */ let c = r#\"crate::w\"#; 'l: loop {}";
        let out = imports::blank(src);
        assert_eq!(out.lines().count(), src.lines().count());
        assert!(!out.contains("crate::"), "{out}");
        assert!(out.contains("loop"), "{out}");
    }
}
