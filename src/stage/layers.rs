//! Which layers each pipeline stage holds.

use std::ops::Range;

use crate::comm::{CommError, CommResult};

/// The layer ranges of `stages` pipeline stages over `layers` layers: `sizes` when given
/// (`--pp-layers 10,10,10`), else as even as possible with the first stages taking one more
/// (30 layers on 4 stages: 8, 8, 7, 7). An error names the sizes when there are more stages
/// than layers, when `sizes` has another length than `stages`, holds a zero, or does not add
/// up to `layers`.
///
/// ```
/// use candle_tp::pipeline::stage_layers;
/// assert_eq!(stage_layers(30, 4, None).unwrap(), vec![0..8, 8..16, 16..23, 23..30]);
/// assert_eq!(stage_layers(30, 3, Some(&[12, 10, 8])).unwrap(), vec![0..12, 12..22, 22..30]);
/// assert!(stage_layers(30, 3, Some(&[10, 10, 9])).is_err());
/// ```
pub fn stage_layers(
    layers: usize,
    stages: usize,
    sizes: Option<&[usize]>,
) -> CommResult<Vec<Range<usize>>> {
    let what = format!("pipeline stages of a {layers}-layer model");
    if stages == 0 || stages > layers {
        return Err(CommError::invalid(
            what,
            format!("{stages} stages: each stage needs at least one of the {layers} layers"),
        ));
    }
    let sizes: Vec<usize> = match sizes {
        Some(s) => {
            let total: usize = s.iter().sum();
            if s.len() != stages || s.contains(&0) || total != layers {
                return Err(CommError::invalid(
                    what,
                    format!(
                        "layers per stage {s:?} ({} stages, {total} layers) must be {stages} \
                         sizes of at least 1 that add up to {layers}",
                        s.len()
                    ),
                ));
            }
            s.to_vec()
        }
        None => (0..stages)
            .map(|i| layers / stages + usize::from(i < layers % stages))
            .collect(),
    };
    let mut at = 0;
    Ok(sizes
        .iter()
        .map(|&n| {
            at += n;
            at - n..at
        })
        .collect())
}
