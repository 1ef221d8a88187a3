//! Header cases found by `examples/fuzz_checkpoint` that the cases of
//! `tests/loader_safetensors.rs` did not cover.

use candle_tp::loader::SafetensorsSource;

#[test]
fn a_zero_size_tensor_with_overflowing_dimensions_is_refused() -> anyhow::Result<()> {
    // 0 bytes in all, but slicing it multiplies 2^40 x 2^40 (a debug-build overflow panic in
    // the slice arithmetic before the fix).
    let header = r#"{"w": {"dtype": "F32", "shape": [0, 1099511627776, 1099511627776], "data_offsets": [0, 0]}}"#;
    let dir =
        std::env::temp_dir().join(format!("candle-tp-hostile-headers-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("zerohuge.safetensors");
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    std::fs::write(&path, bytes)?;
    let result = SafetensorsSource::from_files(&[&path]);
    std::fs::remove_dir_all(&dir)?;
    let msg = match result {
        Ok(_) => panic!("a [0, 2^40, 2^40] tensor was accepted"),
        Err(e) => e.to_string(),
    };
    for word in ["zerohuge.safetensors", "'w'", "overflows"] {
        assert!(msg.contains(word), "{msg:?} does not mention {word:?}");
    }
    Ok(())
}

/// Writes `header` and `data` as a safetensors file in a fresh directory and returns the error
/// of opening it.
fn open_err(file: &str, header: &str, data: &[u8]) -> anyhow::Result<String> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join(file);
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(&path, bytes)?;
    match SafetensorsSource::from_files(&[&path]) {
        Ok(_) => anyhow::bail!(
            "{file}: header {header} with {} data bytes was accepted",
            data.len()
        ),
        Err(e) => Ok(e.to_string()),
    }
}

#[test]
fn data_with_holes_or_trailing_bytes_is_refused_by_the_safetensors_crate() -> anyhow::Result<()> {
    // The format has no holes and nothing after the last tensor; the crate's validation
    // refuses both (the hand-written parser before it accepted them), and the error still
    // names the file and the tensor.
    let cases: &[(&str, &str, usize, &[&str])] = &[
        (
            "hole.safetensors",
            r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}"#,
            12,
            &["hole.safetensors", "'b'", "starts at byte 8", "end at 4"],
        ),
        (
            "tail.safetensors",
            r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}"#,
            16,
            &["tail.safetensors", "cover 4 bytes", "holds 16"],
        ),
        (
            "meta.safetensors",
            r#"{"__metadata__": {"n": 1}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}"#,
            4,
            &["meta.safetensors", "__metadata__", "strings"],
        ),
    ];
    for (file, header, len, words) in cases {
        let msg = open_err(file, header, &vec![0u8; *len])?;
        for word in *words {
            assert!(msg.contains(word), "{msg:?} does not mention {word:?}");
        }
    }
    Ok(())
}
