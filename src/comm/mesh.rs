//! [`DeviceMesh`]: a process group arranged as a grid of ranks, with a sub-group along every
//! axis (and, for three or more axes, for every pair of axes).
//!
//! # Rank → coordinate mapping (fixed)
//!
//! Ranks are laid out in row-major order, the last axis varying fastest: for a mesh of
//! dims `[d0, d1, …, dn]` the rank with coordinates `(c0, c1, …, cn)` is
//! `((c0 * d1 + c1) * d2 + c2) …`.
//!
//! - 2D grid ([`DeviceMesh::grid_2d`], `q × q`, axes `row`, `col`): `rank = row * q + col`.
//!   The **row group** of a rank is the `q` ranks with its `row` (varying `col`, ordered by
//!   `col`); the **column group** the `q` ranks with its `col` (ordered by `row`).
//! - 3D cube ([`DeviceMesh::cube_3d`], `q × q × q`, axes `i`, `j`, `k`):
//!   `rank = i * q² + j * q + k`. Axis `i` splits the batch; axes `j` and `k` split the
//!   features, and the 3D layers say which of them splits their input and which their output
//!   (see [`crate::nn::parallel_3d`]). [`group_along`](DeviceMesh::group_along)`(a)` is the
//!   `q` ranks that differ from this one only in coordinate `a` (ordered by it);
//!   [`plane`](DeviceMesh::plane)`(a, b)` the `q²` ranks that differ only in `a` and `b`.
//! - DP × TP ([`DeviceMesh::dp_tp`], axes `dp`, `tp`): `rank = dp_index * tp + tp_index`, so
//!   the ranks of one tensor-parallel group are consecutive (on one host, as Megatron does).
//! - PP × DP × TP ([`DeviceMesh::pp_dp_tp`], axes `pp`, `dp`, `tp`): the pipeline stage is the
//!   slowest axis, the tensor-parallel index the fastest.
//!
//! Sub-groups are created with [`ProcessGroup::new_group_named`] by every rank in the same
//! order (axis 0, 1, …, then pairs (0,1), (0,2), …), so construction never deadlocks and every
//! group's name says what it is (`world/row[3,4,5]`).

use super::error::{CommError, CommResult};
use super::group::ProcessGroup;
use super::stats::CommStats;

/// A process group arranged as an n-dimensional grid. See the [module docs](self) for the
/// rank → coordinate mapping.
#[derive(Debug, Clone)]
pub struct DeviceMesh {
    world: ProcessGroup,
    dims: Vec<usize>,
    names: Vec<String>,
    coord: Vec<usize>,
    axes: Vec<ProcessGroup>,
    planes: Vec<((usize, usize), ProcessGroup)>,
}

fn isqrt_exact(n: usize) -> Option<usize> {
    let q = (n as f64).sqrt().round() as usize;
    (q.saturating_sub(1)..=q + 1).find(|&r| r * r == n && r > 0)
}

fn icbrt_exact(n: usize) -> Option<usize> {
    let q = (n as f64).cbrt().round() as usize;
    (q.saturating_sub(1)..=q + 1).find(|&r| r * r * r == n && r > 0)
}

impl DeviceMesh {
    /// Arranges `world` as a grid of `dims` (their product must be the group size), axes named
    /// `names` (one per dim; the names show in the sub-groups' names). Creates the group along
    /// every axis and, with three or more axes, the group of every pair of axes. Collective:
    /// every rank of `world` calls it.
    pub fn new(world: &ProcessGroup, dims: &[usize], names: &[&str]) -> CommResult<Self> {
        let ctx = || {
            format!(
                "DeviceMesh {dims:?} on group '{}' ({} ranks)",
                world.name(),
                world.size()
            )
        };
        if dims.is_empty() || dims.contains(&0) || names.len() != dims.len() {
            return Err(CommError::invalid(
                ctx(),
                format!(
                    "needs at least one non-zero dim and one name per dim (got dims {dims:?}, names {names:?})"
                ),
            ));
        }
        let total: usize = dims.iter().product();
        if total != world.size() {
            return Err(CommError::invalid(
                ctx(),
                format!(
                    "the mesh has {total} positions but the group has {} ranks",
                    world.size()
                ),
            ));
        }
        let coord = Self::coord_of(dims, world.rank());
        let mut mesh = DeviceMesh {
            world: world.clone(),
            dims: dims.to_vec(),
            names: names.iter().map(|s| s.to_string()).collect(),
            coord,
            axes: Vec::new(),
            planes: Vec::new(),
        };
        for (a, name) in names.iter().enumerate() {
            let ranks = mesh.ranks_varying(&[a]);
            mesh.axes.push(mesh.make_group(&ranks, name)?);
        }
        if dims.len() >= 3 {
            for a in 0..dims.len() {
                for b in a + 1..dims.len() {
                    let ranks = mesh.ranks_varying(&[a, b]);
                    let label = format!("{}{}", names[a], names[b]);
                    let g = mesh.make_group(&ranks, &label)?;
                    mesh.planes.push(((a, b), g));
                }
            }
        }
        Ok(mesh)
    }

    fn make_group(&self, ranks: &[usize], label: &str) -> CommResult<ProcessGroup> {
        self.world.new_group_named(ranks, label)?.ok_or_else(|| {
            CommError::invalid(
                format!("DeviceMesh on group '{}'", self.world.name()),
                format!(
                    "rank {} is not in its own sub-group {ranks:?}",
                    self.world.rank()
                ),
            )
        })
    }

    /// A `q × q` grid (2D tensor parallelism, SUMMA): axes `row` and `col`,
    /// `rank = row * q + col`. The group size must be a perfect square.
    pub fn grid_2d(world: &ProcessGroup) -> CommResult<Self> {
        let n = world.size();
        let q = isqrt_exact(n).ok_or_else(|| {
            CommError::invalid(
                format!("2D mesh on group '{}'", world.name()),
                format!("2D tensor parallelism needs a square number of ranks (q × q), got {n}"),
            )
        })?;
        Self::new(world, &[q, q], &["row", "col"])
    }

    /// A `q × q × q` cube (3D tensor parallelism): axes `i`, `j`, `k`,
    /// `rank = i * q² + j * q + k`. The group size must be a perfect cube.
    pub fn cube_3d(world: &ProcessGroup) -> CommResult<Self> {
        let n = world.size();
        let q = icbrt_exact(n).ok_or_else(|| {
            CommError::invalid(
                format!("3D mesh on group '{}'", world.name()),
                format!("3D tensor parallelism needs a cubic number of ranks (q × q × q), got {n}"),
            )
        })?;
        Self::new(world, &[q, q, q], &["i", "j", "k"])
    }

    /// A data-parallel × tensor-parallel arrangement: axes `dp` and `tp`,
    /// `rank = dp_index * tp + tp_index`. `tp` must divide the group size.
    pub fn dp_tp(world: &ProcessGroup, tp: usize) -> CommResult<Self> {
        let n = world.size();
        if tp == 0 || !n.is_multiple_of(tp) {
            return Err(CommError::invalid(
                format!("DP x TP mesh on group '{}'", world.name()),
                format!("the tensor-parallel size {tp} must divide the {n} ranks"),
            ));
        }
        Self::new(world, &[n / tp, tp], &["dp", "tp"])
    }

    /// A pipeline × data-parallel × tensor-parallel arrangement: axes `pp`, `dp` and `tp`,
    /// `rank = (stage * dp + dp_index) * tp + tp_index`, so that a tensor-parallel group is
    /// consecutive ranks (on one host) and the stages are the slowest axis (across hosts), as
    /// Megatron lays them out. `pp · tp` must divide the group size.
    ///
    /// ```
    /// use candle_tp::comm::{run_threads, DeviceMesh};
    /// let coords = run_threads(8, |pg| {
    ///     let mesh = DeviceMesh::pp_dp_tp(&pg, 2, 2)?;
    ///     Ok(mesh.coord().to_vec())
    /// })
    /// .unwrap();
    /// assert_eq!(coords[5], vec![1, 0, 1]); // rank 5: stage 1, data-parallel 0, tp 1
    /// ```
    pub fn pp_dp_tp(world: &ProcessGroup, pp: usize, tp: usize) -> CommResult<Self> {
        let n = world.size();
        if pp == 0 || tp == 0 || !n.is_multiple_of(pp * tp) {
            return Err(CommError::invalid(
                format!("PP x DP x TP mesh on group '{}'", world.name()),
                format!(
                    "the pipeline size {pp} times the tensor-parallel size {tp} must divide the \
                     {n} ranks"
                ),
            ));
        }
        Self::new(world, &[pp, n / (pp * tp), tp], &["pp", "dp", "tp"])
    }

    /// The coordinates of `rank` in a mesh of `dims` (row-major, last axis fastest).
    pub fn coord_of(dims: &[usize], rank: usize) -> Vec<usize> {
        let mut c = vec![0; dims.len()];
        let mut r = rank;
        for a in (0..dims.len()).rev() {
            c[a] = r % dims[a];
            r /= dims[a];
        }
        c
    }

    /// The rank at coordinates `coord` in a mesh of `dims` (row-major, last axis fastest).
    pub fn rank_of(dims: &[usize], coord: &[usize]) -> usize {
        dims.iter().zip(coord).fold(0, |acc, (d, c)| acc * d + c)
    }

    /// Ranks (in `world` numbering) that share this rank's coordinates except on `axes`,
    /// ordered row-major over those axes.
    fn ranks_varying(&self, axes: &[usize]) -> Vec<usize> {
        let n: usize = axes.iter().map(|&a| self.dims[a]).product();
        (0..n)
            .map(|idx| {
                let mut c = self.coord.clone();
                let mut r = idx;
                for &a in axes.iter().rev() {
                    c[a] = r % self.dims[a];
                    r /= self.dims[a];
                }
                Self::rank_of(&self.dims, &c)
            })
            .collect()
    }

    /// The whole group.
    pub fn world(&self) -> &ProcessGroup {
        &self.world
    }

    /// Size of every axis.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The axes' names.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// This rank's coordinates.
    pub fn coord(&self) -> &[usize] {
        &self.coord
    }

    /// The ranks that differ from this one only along `axis`, ordered by that coordinate (so
    /// this rank's rank in it is `coord()[axis]`). `None` for an axis the mesh does not have.
    pub fn group_along(&self, axis: usize) -> Option<&ProcessGroup> {
        self.axes.get(axis)
    }

    /// The ranks that differ from this one only along axes `a` and `b` (row-major over
    /// `(a, b)`, `a < b`). Created for meshes of three or more axes; for two axes it is the
    /// whole group.
    pub fn plane(&self, a: usize, b: usize) -> Option<&ProcessGroup> {
        let (a, b) = (a.min(b), a.max(b));
        if self.dims.len() == 2 && (a, b) == (0, 1) {
            return Some(&self.world);
        }
        self.planes
            .iter()
            .find(|(k, _)| *k == (a, b))
            .map(|(_, g)| g)
    }

    /// 2D: the `q` ranks of this rank's row (same `row`, ordered by `col`).
    pub fn row_group(&self) -> Option<&ProcessGroup> {
        (self.dims.len() == 2).then(|| &self.axes[1])
    }

    /// 2D: the `q` ranks of this rank's column (same `col`, ordered by `row`).
    pub fn col_group(&self) -> Option<&ProcessGroup> {
        (self.dims.len() == 2).then(|| &self.axes[0])
    }

    /// Every group of the mesh: the world, the axis groups, the plane groups.
    pub fn groups(&self) -> Vec<&ProcessGroup> {
        let mut v = vec![&self.world];
        v.extend(self.axes.iter());
        v.extend(self.planes.iter().map(|(_, g)| g));
        v
    }

    /// This rank's counters summed over every group of the mesh.
    pub fn stats(&self) -> CommStats {
        let mut s = CommStats::default();
        for g in self.groups() {
            s.add(&g.stats());
        }
        s
    }

    /// Zeroes this rank's counters of every group of the mesh.
    pub fn reset_stats(&self) {
        for g in self.groups() {
            g.reset_stats();
        }
    }

    /// The side `q` of a square (2D) or cubic (3D) mesh: every axis the same size.
    pub fn side(&self) -> Option<usize> {
        let q = self.dims[0];
        self.dims.iter().all(|&d| d == q).then_some(q)
    }
}
