//! How a dimension is split across ranks.
//!
//! One small type serves weights, heads, vocabulary rows and sequence positions alike. Sizes
//! differ by at most one *unit*, where the unit is what must not be cut (one column, one
//! attention head of `head_dim` columns, one KV group, a quantization block). The first
//! `units % parts` ranks get one unit more: 1000 columns on 3 ranks is 334 + 333 + 333, and 9
//! heads on 2 ranks is 5 + 4. Uneven sizes are supported, not refused. A split can also give
//! its first ranks fewer units on purpose ([`Partition::balancing`]), for ranks that carry
//! other work before the same collective.

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
    /// The first `lead` parts hold `lead_units` units each, the others `rest_units` (`lead` is
    /// 0 when every part holds `rest_units`).
    lead: usize,
    lead_units: usize,
    rest_units: usize,
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
        let units = total / unit;
        Ok(Self::from_units(
            total,
            parts,
            unit,
            units % parts,
            units / parts + 1,
            units / parts,
        ))
    }

    /// The split whose first `lead` parts hold `lead_units` units and the others `rest_units`,
    /// normalised so that equal splits compare equal.
    fn from_units(
        total: usize,
        parts: usize,
        unit: usize,
        lead: usize,
        lead_units: usize,
        rest_units: usize,
    ) -> Self {
        let (lead, lead_units) = if lead == 0 || lead_units == rest_units {
            (0, rest_units)
        } else {
            (lead, lead_units)
        };
        Self {
            total,
            parts,
            unit,
            lead,
            lead_units,
            rest_units,
        }
    }

    /// Splits `total` elements into `parts` ranges in multiples of `unit`, the first
    /// `lead_parts` of which also carry other work worth `lead_extra` elements of this
    /// dimension (a gated MLP's intermediate columns, on ranks that hold one more attention
    /// group): those ranges are shorter, so that each part's elements plus its other work are
    /// as even as whole units allow. The other parts hold equal ranges. Falls back to
    /// [`Partition::with_unit`]'s split where no such split gives a part less to do than
    /// it (a unit too coarse, no other work, or fewer units than parts need).
    ///
    /// ```
    /// use candle_tp::Partition;
    /// // SmolLM2's MLP (1536 columns, blocks of 32) on 2 ranks, the first holding 2 of 3 KV
    /// // groups: its extra q/k/v/o rows weigh ~171 columns.
    /// let p = Partition::balancing(1536, 2, 32, 1, 170.7).unwrap();
    /// assert_eq!(p.sizes(), vec![672, 864]);
    /// ```
    pub fn balancing(
        total: usize,
        parts: usize,
        unit: usize,
        lead_parts: usize,
        lead_extra: f64,
    ) -> Result<Self, PartitionError> {
        let even = Self::with_unit(total, parts, unit)?;
        if lead_parts == 0 || lead_parts >= parts || lead_extra.is_nan() || lead_extra <= 0.0 {
            return Ok(even);
        }
        // Each part's work: its elements, plus `lead_extra` on the lead parts.
        let work = |p: &Self| {
            (0..parts)
                .map(|i| p.size(i) as f64 + if i < lead_parts { lead_extra } else { 0.0 })
                .fold(0f64, f64::max)
        };
        let units = total / unit;
        let rest_parts = parts - lead_parts;
        // The real-valued balance: lead + extra = rest, lead_parts·lead + rest_parts·rest =
        // total; then the whole-unit counts around it whose remainder splits evenly.
        let ideal = (total as f64 - rest_parts as f64 * lead_extra) / parts as f64 / unit as f64;
        let mut best = even;
        for lead_units in [ideal.floor(), ideal.ceil()] {
            // At least one unit each (a NaN or negative ideal: one).
            let lead_units = lead_units.max(1.0) as usize;
            let Some(rest) = units.checked_sub(lead_parts * lead_units) else {
                continue;
            };
            if rest % rest_parts != 0 || rest / rest_parts == 0 {
                continue;
            }
            let p = Self::from_units(
                total,
                parts,
                unit,
                lead_parts,
                lead_units,
                rest / rest_parts,
            );
            if work(&p) < work(&best) {
                best = p;
            }
        }
        Ok(best)
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
        if part < self.lead {
            self.lead_units
        } else {
            self.rest_units
        }
    }

    /// Number of elements held by `part`.
    pub fn size(&self, part: usize) -> usize {
        self.units_of(part) * self.unit
    }

    /// First element held by `part`.
    pub fn offset(&self, part: usize) -> usize {
        let lead = part.min(self.lead);
        (lead * self.lead_units + (part - lead) * self.rest_units) * self.unit
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
        self.lead == 0
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

    /// Against the work of every split in whole units, found by brute force: the balanced
    /// split's largest part (elements plus the lead parts' extra work) is the least that a
    /// split with equal lead parts and equal other parts can reach, and its ranges tile the
    /// dimension.
    #[test]
    fn balancing_is_the_least_loaded_split_of_its_form() {
        for (total, parts, unit, lead, extra) in [
            (1536, 2, 32, 1, 170.7),
            (1536, 2, 256, 1, 170.7),
            (2560, 3, 32, 2, 128.0),
            (8192, 4, 32, 2, 300.0),
            (96, 2, 32, 1, 500.0),
            (1536, 2, 32, 1, 0.0),
        ] {
            let p = Partition::balancing(total, parts, unit, lead, extra).unwrap();
            let work = |sizes: &[usize]| {
                sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &s)| s as f64 + if i < lead { extra } else { 0.0 })
                    .fold(0f64, f64::max)
            };
            let units = total / unit;
            let best = (1..units)
                .filter_map(|a| {
                    let rest = units.checked_sub(lead * a)?;
                    (rest % (parts - lead) == 0 && rest > 0).then(|| {
                        let mut s = vec![a * unit; lead];
                        s.resize(parts, rest / (parts - lead) * unit);
                        work(&s)
                    })
                })
                .fold(
                    work(&Partition::with_unit(total, parts, unit).unwrap().sizes()),
                    f64::min,
                );
            let case = format!("{total}/{parts} by {unit}, {lead} lead with {extra}");
            assert_eq!(work(&p.sizes()), best, "{case}: {:?}", p.sizes());
            assert_eq!(p.sizes().iter().sum::<usize>(), total, "{case}");
            let mut next = 0;
            for r in 0..parts {
                assert_eq!(p.range(r).start, next, "{case}");
                assert!(p.size(r).is_multiple_of(unit) && p.size(r) > 0, "{case}");
                next = p.range(r).end;
                assert_eq!(p.owner(next - 1), Some(r), "{case}");
            }
        }
        let p = Partition::balancing(1536, 2, 32, 1, 170.7).unwrap();
        assert_eq!(p.sizes(), vec![672, 864]);
        assert!(!p.is_even());
        // Too coarse to help (6 units of 256): the even split, equal to `with_unit`'s.
        let p = Partition::balancing(1536, 2, 256, 1, 170.7).unwrap();
        assert_eq!(p, Partition::with_unit(1536, 2, 256).unwrap());
        assert!(p.is_even());
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
