//! The memory-mapped safetensors source against candle's own writer and `narrow`/`cat`.
//!
//! Fixtures are written with `candle_core::safetensors::save` (independent of the parser
//! under test), and every slice is compared with `Tensor::narrow` + `Tensor::cat` of the full
//! tensor. Broken and hostile files are written byte by byte.

// `load_ranges` takes a list of ranges; one-range lists are the common case here.
#![allow(clippy::single_range_in_vec_init)]

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_tp::loader::{RangeRequest, SafetensorsSource, TensorSource};
use candle_tp::Partition;

/// `src.load_ranges` of the request for `ranges` along `dim` of `name`.
fn load_ranges(
    src: &impl TensorSource,
    name: &str,
    dim: usize,
    ranges: &[Range<usize>],
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    src.load_ranges(&RangeRequest {
        name,
        dim,
        ranges,
        dtype,
        device,
    })
}

/// A unique temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Result<Self> {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "candle_tp_st_{tag}_{}_{}_{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Distinct, non-trivial values (not exactly representable in f16/bf16).
fn values(shape: &[usize], dtype: DType) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let t = Tensor::arange(0u32, n as u32, &Device::Cpu)?.to_dtype(DType::F32)?;
    let t = match dtype {
        DType::U8 | DType::U32 | DType::I64 => {
            let v: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % 251).collect();
            Tensor::from_vec(v, n, &Device::Cpu)?
        }
        _ => ((t * 0.731)?.sin()? * 3.0)?,
    };
    Ok(t.reshape(shape)?.to_dtype(dtype)?)
}

/// The reference: narrow + cat of the full tensor.
fn reference(full: &Tensor, dim: usize, ranges: &[Range<usize>]) -> Result<Tensor> {
    let parts = ranges
        .iter()
        .map(|r| full.narrow(dim, r.start, r.end - r.start))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, dim)?)
}

/// Exact equality of shape, dtype and every value.
fn assert_same(got: &Tensor, want: &Tensor, what: &str) -> Result<()> {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let g = got.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let w = want.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    assert!(g == w, "{what}: values differ");
    Ok(())
}

fn err_of<T: std::fmt::Debug>(r: candle_core::Result<T>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(msg: &str, words: &[&str]) {
    for w in words {
        assert!(msg.contains(w), "error {msg:?} should mention {w:?}");
    }
}

/// Writes a safetensors file by hand: length prefix, header text, data bytes.
fn write_raw(path: &Path, header: &str, data: &[u8]) -> Result<()> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes)?;
    Ok(())
}

#[test]
fn source_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<SafetensorsSource>();
}

#[test]
fn every_dim_every_split_matches_narrow_and_cat() -> Result<()> {
    let dir = TempDir::new("splits")?;
    let shapes: Vec<(&str, Vec<usize>, DType)> = vec![
        ("a.vec", vec![1000], DType::F32),
        ("b.mat", vec![7, 10], DType::F32),
        ("c.cube", vec![3, 5, 6], DType::BF16),
        ("d.four", vec![2, 3, 4, 5], DType::F16),
        ("e.f64", vec![4, 9], DType::F64),
        ("f.i64", vec![5, 3], DType::I64),
        ("g.u32", vec![3, 7], DType::U32),
        ("h.u8", vec![6, 5, 2], DType::U8),
        ("i.big", vec![1000, 64], DType::F32),
    ];
    let mut map = HashMap::new();
    for (name, shape, dtype) in &shapes {
        map.insert(name.to_string(), values(shape, *dtype)?);
    }
    let path = dir.path().join("model.safetensors");
    candle_core::safetensors::save(&map, &path)?;
    let src = SafetensorsSource::from_dir(dir.path())?;
    let mut names: Vec<String> = map.keys().cloned().collect();
    names.sort();
    assert_eq!(src.names(), names);

    let cpu = Device::Cpu;
    for (name, shape, dtype) in &shapes {
        let full = &map[*name];
        assert_eq!(src.dtype(name)?, Some(*dtype));
        assert_eq!(
            src.shape(name)?.map(|s| s.dims().to_vec()),
            Some(shape.clone())
        );
        assert_same(&src.load(name, *dtype, &cpu)?, full, name)?;
        for (dim, &size) in shape.iter().enumerate() {
            // Even and uneven splits over 1..=3 ranks.
            for parts in 1..=size.min(3) {
                let p = Partition::new(size, parts)?;
                for rank in 0..parts {
                    let r = [p.range(rank)];
                    let got = load_ranges(&src, name, dim, &r, *dtype, &cpu)?;
                    let what = format!("{name} dim {dim} rank {rank}/{parts}");
                    assert_same(&got, &reference(full, dim, &r)?, &what)?;
                }
            }
            // Several ranges, out of order, one of them empty.
            if size >= 3 {
                let ranges = [size - 1..size, 0..1, 1..1, 1..size - 1];
                let got = load_ranges(&src, name, dim, &ranges, *dtype, &cpu)?;
                let what = format!("{name} dim {dim} multi-range");
                assert_same(&got, &reference(full, dim, &ranges)?, &what)?;
            }
        }
    }
    Ok(())
}

#[test]
fn fused_qkv_rows_of_one_rank() -> Result<()> {
    // A fused [q; k; v] weight: 9 q heads and 3 kv heads of 4 rows each, 8 columns; rank 1 of
    // 2 takes its heads of q, k and v.
    let dir = TempDir::new("fused")?;
    let (hd, q, kv, cols) = (4, 9, 3, 8);
    let full = values(&[(q + 2 * kv) * hd, cols], DType::F32)?;
    let path = dir.path().join("model.safetensors");
    candle_core::safetensors::save(&HashMap::from([("qkv", full.clone())]), &path)?;
    let src = SafetensorsSource::from_files(&[&path])?;
    let qp = Partition::with_unit(q * hd, 2, hd)?;
    let kp = Partition::with_unit(kv * hd, 2, hd)?;
    let shift = |r: Range<usize>, by: usize| r.start + by..r.end + by;
    for rank in 0..2 {
        let ranges = [
            qp.range(rank),
            shift(kp.range(rank), q * hd),
            shift(kp.range(rank), (q + kv) * hd),
        ];
        let got = load_ranges(&src, "qkv", 0, &ranges, DType::F32, &Device::Cpu)?;
        assert_same(&got, &reference(&full, 0, &ranges)?, "fused qkv")?;
        // The same along the columns of the transposed layout.
        let got_t = load_ranges(&src, "qkv", 1, &[0..3, 5..8], DType::F32, &Device::Cpu)?;
        assert_same(&got_t, &reference(&full, 1, &[0..3, 5..8])?, "cols")?;
    }
    Ok(())
}

#[test]
fn converts_only_the_slice_like_to_dtype() -> Result<()> {
    let dir = TempDir::new("convert")?;
    let f = values(&[10, 12], DType::F32)?;
    let b = values(&[12, 10], DType::BF16)?;
    let path = dir.path().join("model.safetensors");
    candle_core::safetensors::save(&HashMap::from([("f", f.clone()), ("b", b.clone())]), &path)?;
    let src = SafetensorsSource::from_dir(dir.path())?;
    let cpu = Device::Cpu;
    let p = Partition::new(12, 3)?;
    for rank in 0..3 {
        let r = [p.range(rank)];
        for to in [DType::F16, DType::BF16, DType::F64] {
            let want = reference(&f, 1, &r)?.to_dtype(to)?;
            assert_same(&load_ranges(&src, "f", 1, &r, to, &cpu)?, &want, "f32->x")?;
        }
        let want = reference(&b, 0, &r)?.to_dtype(DType::F32)?;
        assert_same(
            &load_ranges(&src, "b", 0, &r, DType::F32, &cpu)?,
            &want,
            "bf16->f32",
        )?;
    }
    assert_same(
        &src.load("b", DType::F32, &cpu)?,
        &b.to_dtype(DType::F32)?,
        "full",
    )?;
    Ok(())
}

#[test]
fn sharded_checkpoint_with_index() -> Result<()> {
    let dir = TempDir::new("index")?;
    let a = values(&[6, 4], DType::F32)?;
    let b = values(&[5], DType::BF16)?;
    let c = values(&[3, 3, 2], DType::F16)?;
    let s1 = "model-00001-of-00002.safetensors";
    let s2 = "model-00002-of-00002.safetensors";
    candle_core::safetensors::save(
        &HashMap::from([("layer.0.a", a.clone()), ("layer.0.b", b.clone())]),
        dir.path().join(s1),
    )?;
    candle_core::safetensors::save(
        &HashMap::from([("layer.1.c", c.clone())]),
        dir.path().join(s2),
    )?;
    let index = format!(
        r#"{{"metadata": {{"total_size": 100}}, "weight_map": {{"layer.0.a": "{s1}", "layer.0.b": "{s1}", "layer.1.c": "{s2}"}}}}"#
    );
    std::fs::write(dir.path().join("model.safetensors.index.json"), index)?;
    let src = SafetensorsSource::from_dir(dir.path())?;
    assert_eq!(src.names(), vec!["layer.0.a", "layer.0.b", "layer.1.c"]);
    let cpu = Device::Cpu;
    assert_same(&src.load("layer.0.b", DType::BF16, &cpu)?, &b, "b")?;
    let r = [1..3];
    assert_same(
        &load_ranges(&src, "layer.0.a", 1, &r, DType::F32, &cpu)?,
        &reference(&a, 1, &r)?,
        "a",
    )?;
    assert_same(
        &load_ranges(&src, "layer.1.c", 2, &[1..2], DType::F16, &cpu)?,
        &reference(&c, 2, &[1..2])?,
        "c",
    )?;
    assert_eq!(src.shape("nope")?, None);
    Ok(())
}

#[test]
fn missing_files_and_tensors_are_named() -> Result<()> {
    let dir = TempDir::new("missing")?;
    let msg = err_of(SafetensorsSource::from_dir(dir.path()));
    let d = dir.path().display().to_string();
    assert_mentions(
        &msg,
        &[&d, "model.safetensors", "model.safetensors.index.json"],
    );
    let msg = err_of(SafetensorsSource::from_dir(dir.path().join("absent")));
    assert_mentions(&msg, &["absent", "model.safetensors"]);

    let path = dir.path().join("model.safetensors");
    let w = values(&[7, 3], DType::F32)?;
    candle_core::safetensors::save(
        &HashMap::from([("model.layers.0.mlp.up_proj.weight", w)]),
        &path,
    )?;
    let src = SafetensorsSource::from_dir(dir.path())?;
    let msg = err_of(src.load(
        "model.layers.0.mlp.up_proj.wieght",
        DType::F32,
        &Device::Cpu,
    ));
    assert_mentions(
        &msg,
        &[
            "up_proj.wieght",
            "model.safetensors",
            "similar",
            "'model.layers.0.mlp.up_proj.weight'",
        ],
    );
    let name = "model.layers.0.mlp.up_proj.weight";
    let cpu = Device::Cpu;
    let msg = err_of(load_ranges(&src, name, 0, &[5..8], DType::F32, &cpu));
    assert_mentions(
        &msg,
        &[name, "5..8", "out of bounds", "size 7", "model.safetensors"],
    );
    let msg = err_of(load_ranges(&src, name, 2, &[0..1], DType::F32, &cpu));
    assert_mentions(&msg, &[name, "dimension 2", "[7, 3]"]);
    let msg = err_of(load_ranges(&src, name, 0, &[], DType::F32, &cpu));
    assert_mentions(&msg, &[name, "empty"]);
    Ok(())
}

#[test]
fn hostile_headers_are_refused_with_clear_errors() -> Result<()> {
    let dir = TempDir::new("hostile")?;
    let open = |file: &str| SafetensorsSource::from_files(&[dir.path().join(file)]).map(|_| ());
    let data = [0u8; 64];

    std::fs::write(dir.path().join("tiny.safetensors"), [1u8, 2, 3])?;
    assert_mentions(
        &err_of(open("tiny.safetensors")),
        &["tiny.safetensors", "truncated", "3 bytes"],
    );

    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(dir.path().join("short.safetensors"), bytes)?;
    assert_mentions(
        &err_of(open("short.safetensors")),
        &["short.safetensors", "truncated", "1000"],
    );

    let mut bytes = (1u64 << 40).to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(dir.path().join("absurd.safetensors"), bytes)?;
    assert_mentions(
        &err_of(open("absurd.safetensors")),
        &["absurd.safetensors", "absurd"],
    );

    write_raw(&dir.path().join("notjson.safetensors"), "{not json", &data)?;
    assert_mentions(
        &err_of(open("notjson.safetensors")),
        &["notjson.safetensors", "JSON"],
    );
    write_raw(&dir.path().join("array.safetensors"), "[1, 2]", &data)?;
    assert_mentions(
        &err_of(open("array.safetensors")),
        &["array.safetensors", "JSON object"],
    );

    let cases: &[(&str, &str, &[&str])] = &[
        (
            "fields",
            r#"{"w": {"dtype": "F32", "shape": [2]}}"#,
            &["'w'", "data_offsets"],
        ),
        (
            "reversed",
            r#"{"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}"#,
            &["'w'", "reversed", "[8, 0]"],
        ),
        (
            "pastend",
            r#"{"w": {"dtype": "F32", "shape": [20], "data_offsets": [0, 80]}}"#,
            &["'w'", "past the end", "64 bytes"],
        ),
        (
            "overlap",
            r#"{"__metadata__": {"format": "pt"},
                "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
                "v": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}"#,
            &["'w'", "'v'", "overlap"],
        ),
        (
            "size",
            r#"{"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}"#,
            &["'w'", "[3]", "needs 12 bytes", "hold 16"],
        ),
        (
            "overflow",
            r#"{"w": {"dtype": "F32", "shape": [1099511627776, 1099511627776, 1099511627776], "data_offsets": [0, 16]}}"#,
            &["'w'", "overflows"],
        ),
        (
            "unknown",
            r#"{"w": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 4]}}"#,
            &["'w'", "Q9"],
        ),
    ];
    for (file, header, words) in cases {
        let name = format!("{file}.safetensors");
        write_raw(&dir.path().join(&name), header, &data)?;
        let msg = err_of(open(&name));
        assert_mentions(&msg, &[name.as_str()]);
        assert_mentions(&msg, words);
    }

    // A dtype safetensors knows but this source cannot load: opening works, loading names it.
    let path = dir.path().join("int32.safetensors");
    write_raw(
        &path,
        r#"{"ok": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            "ints": {"dtype": "I32", "shape": [2], "data_offsets": [4, 12]}}"#,
        &data[..12],
    )?;
    let src = SafetensorsSource::from_files(&[&path])?;
    let msg = err_of(src.load("ints", DType::F32, &Device::Cpu));
    assert_mentions(
        &msg,
        &["'ints'", "I32", "int32.safetensors", "not supported"],
    );
    assert_mentions(&err_of(src.dtype("ints")), &["'ints'", "I32"]);
    assert_eq!(
        src.load("ok", DType::U8, &Device::Cpu)?.to_vec1::<u8>()?,
        vec![0; 4]
    );
    Ok(())
}

#[test]
fn truncated_and_duplicated_files_are_refused() -> Result<()> {
    let dir = TempDir::new("trunc")?;
    let path = dir.path().join("model.safetensors");
    let t = values(&[16, 16], DType::F32)?;
    candle_core::safetensors::save(&HashMap::from([("w", t)]), &path)?;
    let bytes = std::fs::read(&path)?;
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 10])?;
    let msg = err_of(SafetensorsSource::from_files(&[&cut]));
    assert_mentions(
        &msg,
        &["cut.safetensors", "'w'", "past the end", "truncated"],
    );

    let msg = err_of(SafetensorsSource::from_files(&[&path, &path]));
    assert_mentions(&msg, &["'w'", "model.safetensors", "both"]);
    Ok(())
}

#[test]
fn hostile_indexes_are_refused() -> Result<()> {
    let dir = TempDir::new("badindex")?;
    let shard = "model-00001-of-00001.safetensors";
    let t = values(&[2, 2], DType::F32)?;
    candle_core::safetensors::save(&HashMap::from([("w", t)]), dir.path().join(shard))?;
    let index = dir.path().join("model.safetensors.index.json");
    let check = |json: &str, words: &[&str]| -> Result<()> {
        std::fs::write(&index, json)?;
        let msg = err_of(SafetensorsSource::from_dir(dir.path()));
        assert_mentions(&msg, &["model.safetensors.index.json"]);
        assert_mentions(&msg, words);
        Ok(())
    };
    check("{oops", &["JSON"])?;
    check(r#"{"metadata": {}}"#, &["weight_map"])?;
    check(r#"{"weight_map": {"w": 3}}"#, &["'w'"])?;
    check(
        r#"{"weight_map": {"w": "model-00002-of-00002.safetensors"}}"#,
        &["model-00002-of-00002.safetensors", "missing"],
    )?;
    check(
        r#"{"weight_map": {"w": "/etc/passwd"}}"#,
        &["/etc/passwd", "refused"],
    )?;
    check(
        r#"{"weight_map": {"w": "../outside.safetensors"}}"#,
        &["../outside.safetensors", "refused"],
    )?;
    check(
        r#"{"weight_map": {"w": "sub/../../x.safetensors"}}"#,
        &["refused"],
    )?;
    check(r#"{"weight_map": {"w": ""}}"#, &["refused"])?;
    check(
        &format!(r#"{{"weight_map": {{"w": "{shard}", "ghost": "{shard}"}}}}"#),
        &["'ghost'", shard, "does not contain"],
    )?;
    // And the well-formed index opens.
    std::fs::write(&index, format!(r#"{{"weight_map": {{"w": "./{shard}"}}}}"#))?;
    assert_eq!(SafetensorsSource::from_dir(dir.path())?.names(), vec!["w"]);
    Ok(())
}
