//! How a dimension is split across ranks.
//!
//! One small type serves weights, heads, vocabulary rows and sequence positions alike. Sizes
//! differ by at most one *unit*, where the unit is what must not be cut (one column, one
//! attention head of `head_dim` columns, one KV group, a quantization block). The first
//! `units % parts` ranks get one unit more: 1000 columns on 3 ranks is 334 + 333 + 333, and 9
//! heads on 2 ranks is 5 + 4. Uneven sizes are supported, not refused.

use std::ops::Range;

/// A split of `total` elements into `parts` contiguous ranges, in multiples of `unit`.
///
/// ```
/// use candle_tp::Partition;
/// let p = Partition::new(1000, 3).unwrap();
/// assert_eq!(p.sizes(), vec![334, 333, 333]);
/// assert_eq!(p.range(1), 334..667);
/// // 9 heads of 64 columns on 2 ranks: 5 heads + 4 heads.
/// let heads = Partition::with_unit(9 * 64, 2, 64).unwrap();
/// assert_eq!(heads.sizes(), vec![320, 256]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Partition {
    total: usize,
    parts: usize,
    unit: usize,
}

impl Partition {
    /// Splits `total` elements into `parts` ranges (unit 1).
    pub fn new(total: usize, parts: usize) -> Result<Self, PartitionError> {
        Self::with_unit(total, parts, 1)
    }

    /// Splits `total` elements into `parts` ranges whose sizes are multiples of `unit`.
    ///
    /// Errors when `unit` does not divide `total`, or when there are fewer units than parts
    /// (a rank would get nothing: a dimension smaller than the world size).
    pub fn with_unit(total: usize, parts: usize, unit: usize) -> Result<Self, PartitionError> {
        if parts == 0 || unit == 0 {
            return Err(PartitionError {
                total,
                parts,
                unit,
                reason: "the number of parts and the unit must be at least 1",
            });
        }
        if !total.is_multiple_of(unit) {
            return Err(PartitionError {
                total,
                parts,
                unit,
                reason: "the size is not a multiple of the unit",
            });
        }
        if total / unit < parts {
            return Err(PartitionError {
                total,
                parts,
                unit,
                reason: "there are fewer units than ranks, so some rank would hold nothing",
            });
        }
        Ok(Self { total, parts, unit })
    }

    /// Total number of elements.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Number of parts (ranks).
    pub fn parts(&self) -> usize {
        self.parts
    }

    /// The unit that is never cut.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// Number of units held by `part`.
    pub fn units_of(&self, part: usize) -> usize {
        let units = self.total / self.unit;
        units / self.parts + usize::from(part < units % self.parts)
    }

    /// Number of elements held by `part`.
    pub fn size(&self, part: usize) -> usize {
        self.units_of(part) * self.unit
    }

    /// First element held by `part`.
    pub fn offset(&self, part: usize) -> usize {
        let units = self.total / self.unit;
        let (base, extra) = (units / self.parts, units % self.parts);
        (part * base + part.min(extra)) * self.unit
    }

    /// The elements held by `part`.
    pub fn range(&self, part: usize) -> Range<usize> {
        let o = self.offset(part);
        o..o + self.size(part)
    }

    /// The size of every part, in order.
    pub fn sizes(&self) -> Vec<usize> {
        (0..self.parts).map(|p| self.size(p)).collect()
    }

    /// Whether every part has the same size.
    pub fn is_even(&self) -> bool {
        (self.total / self.unit).is_multiple_of(self.parts)
    }

    /// The part that holds element `index` (`None` past the end).
    pub fn owner(&self, index: usize) -> Option<usize> {
        if index >= self.total {
            return None;
        }
        (0..self.parts).find(|&p| self.range(p).contains(&index))
    }
}

/// A dimension cannot be split as asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionError {
    /// Elements to split.
    pub total: usize,
    /// Ranks to split them over.
    pub parts: usize,
    /// The unit that must not be cut.
    pub unit: usize,
    /// Why it cannot be done.
    pub reason: &'static str,
}

impl std::fmt::Display for PartitionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cannot split {} elements over {} ranks in units of {}: {}",
            self.total, self.parts, self.unit, self.reason
        )
    }
}

impl std::error::Error for PartitionError {}

impl From<PartitionError> for candle_core::Error {
    fn from(e: PartitionError) -> Self {
        candle_core::Error::wrap(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_differ_by_at_most_one_unit_and_cover_everything() {
        for total in 1..60 {
            for parts in 1..=total.min(9) {
                let p = Partition::new(total, parts).unwrap();
                let sizes = p.sizes();
                assert_eq!(sizes.iter().sum::<usize>(), total);
                let (mn, mx) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                assert!(mx - mn <= 1, "{total}/{parts}: {sizes:?}");
                let mut next = 0;
                for r in 0..parts {
                    assert_eq!(p.range(r).start, next);
                    next = p.range(r).end;
                    for i in p.range(r) {
                        assert_eq!(p.owner(i), Some(r));
                    }
                }
                assert_eq!(next, total);
            }
        }
    }

    #[test]
    fn units_are_never_cut() {
        let p = Partition::with_unit(9 * 64, 2, 64).unwrap();
        assert_eq!(p.sizes(), vec![5 * 64, 4 * 64]);
        assert_eq!(p.range(1), 320..576);
        assert!(!p.is_even());
    }

    #[test]
    fn refuses_what_cannot_be_split() {
        let e = Partition::new(2, 3).unwrap_err();
        assert!(e.to_string().contains("fewer units than ranks"), "{e}");
        let e = Partition::with_unit(100, 2, 64).unwrap_err();
        assert!(e.to_string().contains("not a multiple"), "{e}");
        assert!(Partition::new(10, 0).is_err());
    }
}
