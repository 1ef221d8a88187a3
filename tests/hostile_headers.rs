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
