//! The crate's import graph, read from its sources: one node per file (a module), one edge
//! per `use` line or inline path (`crate::…`, `super::…`, `self::…`, a child module's name)
//! from the module that names it to the file that defines it.
//!
//! - Paths resolve through re-exports (`pub use`, `pub(crate) use`) to the defining file, so
//!   `crate::comm::ProcessGroup` is an edge to `comm/group.rs`, not to `comm/mod.rs`.
//! - A module re-exporting its own descendants (a `mod.rs` facade) is not an import: the
//!   facade sits above its room.
//! - Inline `mod name { … }` blocks (tests) are modules of their own: their `super::` is the
//!   file around them.
//! - Comments, string and character literals are blanked first; `$crate::` (macro bodies) is
//!   the crate the macro expands in, not an import of this file.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

/// A module path from the crate root (`["comm", "group"]`; empty: `lib.rs`).
pub type Module = Vec<String>;

/// One import: where it is written, and the path it names (absolute, from the crate root).
#[derive(Debug, Clone)]
pub struct Import {
    pub line: usize,
    pub path: Vec<String>,
    /// `pub use` of the module's own descendant: a facade re-export, not an edge.
    pub facade: bool,
}

/// The parsed crate: every file's module path and imports, and each module's re-exports.
#[derive(Debug, Default)]
pub struct Crate {
    /// Module -> file (relative to the crate's `src/`).
    pub files: BTreeMap<Module, String>,
    pub imports: BTreeMap<Module, Vec<Import>>,
    /// Module -> (name it exports -> absolute path of what it re-exports).
    reexports: HashMap<Module, HashMap<String, Vec<String>>>,
}

/// An edge of the file graph, with the line that makes it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    pub from: Module,
    pub to: Module,
    pub line: usize,
}

/// Reads every `.rs` file under `src` (but `src/bin`, whose programs are crates of their own).
pub fn read_dir(src: &Path) -> BTreeMap<String, String> {
    fn walk(dir: &Path, src: &Path, out: &mut BTreeMap<String, String>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
            .map(|e| e.expect("dir entry").path())
            .collect();
        entries.sort();
        for p in entries {
            let rel = p
                .strip_prefix(src)
                .expect("under src")
                .to_string_lossy()
                .into_owned();
            if p.is_dir() {
                if rel != "bin" {
                    walk(&p, src, out);
                }
            } else if rel.ends_with(".rs") {
                let text = std::fs::read_to_string(&p)
                    .unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
                out.insert(rel, text);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, src, &mut out);
    out
}

/// The module path of a file under `src/` (`comm/mod.rs` -> `comm`, `lib.rs` -> root).
fn module_of(rel: &str) -> Module {
    let stem = rel.trim_end_matches(".rs");
    let mut parts: Vec<String> = stem.split('/').map(str::to_string).collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// `src` with comments, string literals and character literals replaced by spaces (newlines
/// kept, so that offsets still give line numbers).
pub fn blank(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = b.to_vec();
    let mut i = 0;
    let wipe = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                let end = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |p| i + p);
                wipe(&mut out, i, end);
                i = end;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let (mut depth, mut j) = (1, i + 2);
                while j < b.len() && depth > 0 {
                    if b[j] == b'/' && b.get(j + 1) == Some(&b'*') {
                        depth += 1;
                        j += 2;
                    } else if b[j] == b'*' && b.get(j + 1) == Some(&b'/') {
                        depth -= 1;
                        j += 2;
                    } else {
                        j += 1;
                    }
                }
                wipe(&mut out, i, j);
                i = j;
            }
            b'r' if (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                // A raw string r"…" or r#"…"# (or an identifier such as r#type).
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let mut close = vec![b'"'];
                close.extend(std::iter::repeat_n(b'#', hashes));
                let start = i + 2 + hashes;
                let end = b[start..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(b.len(), |p| start + p + close.len());
                wipe(&mut out, i, end);
                i = end;
            }
            b'"' => {
                let mut j = i + 1;
                while j < b.len() && b[j] != b'"' {
                    j += if b[j] == b'\\' { 2 } else { 1 };
                }
                let end = (j + 1).min(b.len());
                wipe(&mut out, i, end);
                i = end;
            }
            b'\'' => {
                // A character literal ('x', '\n', '\u{..}') or a lifetime ('a).
                if b.get(i + 1) == Some(&b'\\') {
                    let end = b[i + 2..]
                        .iter()
                        .position(|&c| c == b'\'')
                        .map_or(b.len(), |p| i + 3 + p);
                    wipe(&mut out, i, end);
                    i = end;
                } else if let Some(len) = std::str::from_utf8(&b[i + 1..(i + 6).min(b.len())])
                    .ok()
                    .or_else(|| std::str::from_utf8(&b[i + 1..(i + 5).min(b.len())]).ok())
                    .and_then(|s| s.chars().next())
                    .map(char::len_utf8)
                    .filter(|&l| b.get(i + 1 + l) == Some(&b'\''))
                {
                    wipe(&mut out, i, i + 2 + len);
                    i += 2 + len;
                } else {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The inline modules of a blanked file: (start offset, end offset, name), nested ones after
/// the ones around them.
fn inline_modules(text: &str) -> Vec<(usize, usize, String)> {
    let b = text.as_bytes();
    let mut found = Vec::new();
    let mut i = 0;
    while let Some(p) = text[i..].find("mod ") {
        let at = i + p;
        i = at + 4;
        if at > 0 && is_ident(b[at - 1]) {
            continue;
        }
        let name_start = i + text[i..].len() - text[i..].trim_start().len();
        let name_end = name_start + b[name_start..].iter().take_while(|&&c| is_ident(c)).count();
        let rest = text[name_end..].trim_start();
        if name_end == name_start || !rest.starts_with('{') {
            continue;
        }
        let open = text.len() - rest.len();
        let mut depth = 0usize;
        let mut end = b.len();
        for (k, &c) in b.iter().enumerate().skip(open) {
            match c {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = k;
                        break;
                    }
                }
                _ => {}
            }
        }
        found.push((open, end, text[name_start..name_end].to_string()));
    }
    found
}

/// Splits a use tree (`a::{b, c::d as e}`) into paths, each with the name it binds.
fn use_tree(prefix: &[String], tree: &str, out: &mut Vec<(Vec<String>, Option<String>)>) {
    let tree = tree.trim();
    if let Some(inner) = tree.strip_prefix('{').and_then(|t| t.strip_suffix('}')) {
        let (mut depth, mut start) = (0, 0);
        let bytes = inner.as_bytes();
        for (k, &c) in bytes.iter().enumerate() {
            match c {
                b'{' => depth += 1,
                b'}' => depth -= 1,
                b',' if depth == 0 => {
                    use_tree(prefix, &inner[start..k], out);
                    start = k + 1;
                }
                _ => {}
            }
        }
        use_tree(prefix, &inner[start..], out);
        return;
    }
    if tree.is_empty() {
        return;
    }
    if let Some((head, rest)) = tree.split_once("::") {
        let head = head.trim();
        if !rest.trim_start().starts_with('{') && head.contains(char::is_whitespace) {
            return;
        }
        let mut p = prefix.to_vec();
        p.push(head.to_string());
        use_tree(&p, rest, out);
        return;
    }
    let (name, alias) = match tree.split_once(" as ") {
        Some((n, a)) => (n.trim(), a.trim()),
        None => (tree, tree),
    };
    let mut p = prefix.to_vec();
    if name == "self" {
        let alias = if alias == "self" {
            p.last().cloned()
        } else {
            Some(alias.to_string())
        };
        out.push((p, alias));
    } else {
        p.push(name.to_string());
        out.push((p, (alias != "*").then(|| alias.to_string())));
    }
}

impl Crate {
    /// Parses the files (path under `src/` -> source).
    pub fn parse(sources: &BTreeMap<String, String>) -> Crate {
        let mut c = Crate::default();
        for rel in sources.keys() {
            c.files.insert(module_of(rel), rel.clone());
        }
        let mut pending: BTreeMap<Module, Vec<Import>> = BTreeMap::new();
        for (rel, src) in sources {
            let file_mod = module_of(rel);
            let text = blank(src);
            let inline = inline_modules(&text);
            let module_at = |off: usize| -> Module {
                let mut m = file_mod.clone();
                for (s, e, name) in &inline {
                    if *s < off && off < *e {
                        m.push(name.clone());
                    }
                }
                m
            };
            let line_of = |off: usize| text[..off].matches('\n').count() + 1;
            let mut found = Vec::new();
            let mut use_spans = Vec::new();
            // `use` statements.
            let b = text.as_bytes();
            let mut i = 0;
            while let Some(p) = text[i..].find("use ") {
                let at = i + p;
                i = at + 4;
                if at > 0 && (is_ident(b[at - 1]) || b[at - 1] == b'$') {
                    continue;
                }
                let Some(end) = text[at..].find(';').map(|e| at + e) else {
                    break;
                };
                let before = text[..at].trim_end();
                let public = before.ends_with("pub")
                    || (before.ends_with(')') && {
                        let open = before.rfind('(').unwrap_or(0);
                        before[..open].trim_end().ends_with("pub")
                    });
                let module = module_at(at);
                let mut paths = Vec::new();
                use_tree(&[], &text[at + 4..end], &mut paths);
                for (path, alias) in paths {
                    found.push((line_of(at), module.clone(), path, public, alias));
                }
                use_spans.push((at, end));
                i = end;
            }
            // Inline paths outside use statements.
            let mut k = 0;
            while k < b.len() {
                let in_use = use_spans.iter().any(|&(s, e)| s <= k && k < e);
                let boundary =
                    k == 0 || !(is_ident(b[k - 1]) || b[k - 1] == b':' || b[k - 1] == b'$');
                let word = b[k..].iter().take_while(|&&c| is_ident(c)).count();
                // `crate::`, `super::`, `self::`, or a child module's name (2018 paths).
                let starts = boundary
                    && word > 0
                    && text[k + word..].starts_with("::")
                    && (matches!(&text[k..k + word], "crate" | "super" | "self") || {
                        let mut child = module_at(k);
                        child.push(text[k..k + word].to_string());
                        c.files.contains_key(&child)
                    });
                if starts && !in_use {
                    let len = b[k..]
                        .iter()
                        .take_while(|&&c| is_ident(c) || c == b':')
                        .count();
                    let path: Vec<String> = text[k..k + len]
                        .split("::")
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                        .collect();
                    found.push((line_of(k), module_at(k), path, false, None));
                    k += len;
                } else {
                    k += 1;
                }
            }
            for (line, module, path, public, alias) in found {
                let Some(abs) = c.absolute(&module, &path) else {
                    continue; // another crate (std, candle_core, …)
                };
                let facade = public && abs.len() > module.len() && abs.starts_with(&module);
                if public {
                    if let Some(alias) = &alias {
                        c.reexports
                            .entry(module.clone())
                            .or_default()
                            .insert(alias.clone(), abs.clone());
                    }
                }
                pending.entry(module).or_default().push(Import {
                    line,
                    path: abs,
                    facade,
                });
            }
        }
        for (module, list) in pending {
            // An inline module's imports are its file's.
            let mut owner = module.clone();
            while !c.files.contains_key(&owner) && !owner.is_empty() {
                owner.pop();
            }
            c.imports.entry(owner).or_default().extend(list);
        }
        c
    }

    /// `path` as written in `module`, from the crate root; `None` for another crate's path.
    fn absolute(&self, module: &Module, path: &[String]) -> Option<Vec<String>> {
        let first = path.first()?;
        match first.as_str() {
            "crate" => Some(path[1..].to_vec()),
            "self" => Some([module.as_slice(), &path[1..]].concat()),
            "super" => {
                let mut m = module.clone();
                let mut rest = path;
                while rest.first().map(String::as_str) == Some("super") {
                    m.pop()?;
                    rest = &rest[1..];
                }
                Some([m.as_slice(), rest].concat())
            }
            _ => {
                // A child module of this one, named without `self::` (2018 paths).
                let mut child = module.clone();
                child.push(first.clone());
                self.files
                    .contains_key(&child)
                    .then(|| [module.as_slice(), path].concat())
            }
        }
    }

    /// The file that defines what `path` names: the longest module prefix, followed through
    /// that module's re-exports.
    pub fn resolve(&self, path: &[String]) -> Module {
        let mut path = path.to_vec();
        for _ in 0..16 {
            let len = (0..=path.len())
                .rev()
                .find(|&l| self.files.contains_key(&path[..l]))
                .unwrap_or(0);
            let module = path[..len].to_vec();
            let Some(target) = path
                .get(len)
                .and_then(|name| self.reexports.get(&module)?.get(name))
            else {
                return module;
            };
            if target.as_slice() == &path[..=len] {
                return module;
            }
            path = [target.as_slice(), &path[len + 1..]].concat();
        }
        path
    }

    /// Every edge between two different files (facade re-exports left out).
    pub fn edges(&self) -> BTreeSet<Edge> {
        let mut edges = BTreeSet::new();
        for (from, list) in &self.imports {
            for imp in list.iter().filter(|i| !i.facade) {
                let to = self.resolve(&imp.path);
                if to != *from {
                    edges.insert(Edge {
                        from: from.clone(),
                        to,
                        line: imp.line,
                    });
                }
            }
        }
        edges
    }

    /// The circles of the file graph (strongly connected components of more than one file),
    /// each sorted.
    pub fn circles(&self) -> Vec<Vec<Module>> {
        let edges = self.edges();
        let nodes: Vec<&Module> = self.files.keys().collect();
        let index_of: HashMap<&Module, usize> =
            nodes.iter().enumerate().map(|(i, m)| (*m, i)).collect();
        let mut adj = vec![BTreeSet::new(); nodes.len()];
        for e in &edges {
            if let (Some(&a), Some(&b)) = (index_of.get(&e.from), index_of.get(&e.to)) {
                adj[a].insert(b);
            }
        }
        // Tarjan, iteratively.
        let n = nodes.len();
        let (mut index, mut low) = (vec![usize::MAX; n], vec![0; n]);
        let (mut on, mut stack, mut next, mut out) = (vec![false; n], Vec::new(), 0, Vec::new());
        for root in 0..n {
            if index[root] != usize::MAX {
                continue;
            }
            let mut work: Vec<(usize, Vec<usize>)> = vec![(root, Vec::new())];
            index[root] = next;
            low[root] = next;
            next += 1;
            stack.push(root);
            on[root] = true;
            work[0].1 = adj[root].iter().copied().collect();
            while let Some((v, todo)) = work.last_mut() {
                let v = *v;
                if let Some(w) = todo.pop() {
                    if index[w] == usize::MAX {
                        index[w] = next;
                        low[w] = next;
                        next += 1;
                        stack.push(w);
                        on[w] = true;
                        work.push((w, adj[w].iter().copied().collect()));
                    } else if on[w] {
                        low[v] = low[v].min(index[w]);
                    }
                    continue;
                }
                work.pop();
                if let Some((parent, _)) = work.last() {
                    low[*parent] = low[*parent].min(low[v]);
                }
                if low[v] == index[v] {
                    let mut comp = Vec::new();
                    loop {
                        let w = stack.pop().expect("on stack");
                        on[w] = false;
                        comp.push(nodes[w].clone());
                        if w == v {
                            break;
                        }
                    }
                    if comp.len() > 1 {
                        comp.sort();
                        out.push(comp);
                    }
                }
            }
        }
        out.sort();
        out
    }
}

/// A module path as `a::b` (`crate` for the root).
pub fn name(m: &Module) -> String {
    if m.is_empty() {
        "crate".into()
    } else {
        m.join("::")
    }
}
