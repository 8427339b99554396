//! The codebase's layering, kept by a test: every crate's modules import only
//! modules of their own layer or below, in the order ARCHITECTURE.md declares, and
//! the import graph has no circle.
//!
//! ARCHITECTURE.md holds the order in a fenced block tagged `layers`, one line per
//! crate: `FOLDER: a, b < c < d::e, f`, bottom layer first. A module belongs to the
//! layer of the longest declared path that prefixes it (`compute::scan::opener` is in
//! `compute::scan`'s layer if that is declared, else in `compute`'s); every module
//! must be covered. An import is any `crate::…`, `super::…` or `self::…` path in a
//! file's code (in `use` lines and inline), its comments and strings left out; one
//! naming the crate root (its error and result re-exports) is allowed anywhere.
//! A module's own `mod` declarations are not imports.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// A module: its path from the crate root (`["compute", "scan"]`).
type Module = Vec<String>;

/// One crate's declared order: module path → layer index (bottom is 0).
#[derive(Debug, Default)]
struct Order {
    layers: Vec<(Module, usize)>,
}

impl Order {
    /// Parses `a, b < c < d::e`.
    fn parse(text: &str) -> Order {
        let mut layers = Vec::new();
        for (i, layer) in text.split('<').enumerate() {
            for m in layer.split(',').map(str::trim).filter(|m| !m.is_empty()) {
                layers.push((m.split("::").map(String::from).collect(), i));
            }
        }
        Order { layers }
    }

    /// The layer of `m`: its longest declared prefix's.
    fn layer_of(&self, m: &[String]) -> Option<(usize, &Module)> {
        self.layers
            .iter()
            .filter(|(p, _)| m.starts_with(p))
            .max_by_key(|(p, _)| p.len())
            .map(|(p, l)| (*l, p))
    }
}

/// The `layers` block of ARCHITECTURE.md: crate folder → its order.
fn declared(architecture: &str) -> BTreeMap<String, Order> {
    let mut out = BTreeMap::new();
    let mut inside = false;
    for line in architecture.lines() {
        let t = line.trim();
        if t.starts_with("```") {
            inside = t == "```layers";
            continue;
        }
        if inside && let Some((folder, order)) = t.split_once(':') {
            out.insert(folder.trim().to_string(), Order::parse(order));
        }
    }
    out
}

/// `src` without comments, strings and character literals (their bytes blanked, so
/// offsets and line numbers stay).
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to.min(b.len())] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            let end = b[i..]
                .iter()
                .position(|&c| c == b'\n')
                .map_or(b.len(), |p| i + p);
            blank(&mut out, i, end);
            i = end;
        } else if b[i..].starts_with(b"/*") {
            let (mut depth, mut j) = (1, i + 2);
            while j < b.len() && depth > 0 {
                if b[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if b[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if b[i] == b'r' && (b[i..].starts_with(b"r#\"") || b[i..].starts_with(b"r\"")) {
            let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            let start = i + 2 + hashes;
            let end = b[start..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(b.len(), |p| start + p + close.len());
            blank(&mut out, i, end);
            i = end;
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            blank(&mut out, i, j + 1);
            i = j + 1;
        } else if b[i] == b'\'' && i + 2 < b.len() && (b[i + 1] == b'\\' || b[i + 2] == b'\'') {
            // A character literal (not a lifetime).
            let end = b[i + 2..]
                .iter()
                .position(|&c| c == b'\'')
                .map_or(b.len(), |p| i + 2 + p + 1);
            blank(&mut out, i, end);
            i = end;
        } else {
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The paths of a `use` tree after its prefix (`a::{b, c::d}` → `a::b`, `a::c::d`).
fn expand(tree: &str) -> Vec<Vec<String>> {
    let t = tree.trim();
    if let Some(inner) = t.strip_prefix('{').and_then(|t| t.strip_suffix('}')) {
        let (mut parts, mut depth, mut cur) = (Vec::new(), 0, String::new());
        for c in inner.chars() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            if c == ',' && depth == 0 {
                parts.push(std::mem::take(&mut cur));
            } else {
                cur.push(c);
            }
        }
        parts.push(cur);
        return parts
            .iter()
            .filter(|p| !p.trim().is_empty())
            .flat_map(|p| expand(p))
            .collect();
    }
    match t.split_once("::") {
        Some((head, rest)) => expand(rest)
            .into_iter()
            .map(|mut p| {
                p.insert(0, head.trim().to_string());
                p
            })
            .collect(),
        None => vec![vec![t.split_whitespace().next().unwrap_or("").to_string()]],
    }
}

fn ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Every `crate::`/`super::`/`self::` path in `code`, and every path that starts
/// with one of `children` (the file's own child modules, named bare: `child::x`),
/// with its byte offset.
fn paths(code: &str, children: &[String]) -> Vec<(Vec<String>, usize)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let at_word = i == 0 || !(ident(b[i - 1]) || b[i - 1] == b':' || b[i - 1] == b'.');
        let kw = ["crate", "super", "self"]
            .into_iter()
            .chain(children.iter().map(String::as_str))
            .find(|k| {
                b[i..].starts_with(k.as_bytes())
                    && code[i + k.len()..].trim_start().starts_with("::")
            });
        let Some(kw) = kw.filter(|_| at_word) else {
            i += 1;
            continue;
        };
        // The whole path, a `use` tree's braces included.
        let (mut depth, mut end) = (0i32, i);
        for (j, c) in code[i..].char_indices() {
            let part = c.is_alphanumeric()
                || c == '_'
                || c == ':'
                || c == '{'
                || (depth > 0 && (c == '}' || c == ',' || c == '*' || c.is_whitespace()));
            if !part {
                break;
            }
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            end = i + j + c.len_utf8();
        }
        for p in expand(&code[i..end]) {
            out.push((p, i));
        }
        i = end.max(i + kw.len());
    }
    out
}

/// A module's path from its file (`src/a/b.rs`, `src/a/b/mod.rs` → `[a, b]`).
fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut m: Module = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(m.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        m.pop();
    }
    m
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// One import: from a module to another, where.
#[derive(Debug, Clone)]
struct Import {
    from: Module,
    to: Module,
    file: PathBuf,
    line: usize,
}

/// The imports between a crate's modules (its `src/`).
fn imports(src: &Path) -> (BTreeSet<Module>, Vec<Import>) {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let modules: BTreeSet<Module> = files.iter().map(|f| module_of(src, f)).collect();
    let mut out = Vec::new();
    for f in &files {
        let me = module_of(src, f);
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        let code = code_only(&text);
        // Inline `mod x { … }` blocks: `super` inside one names the file's module.
        let mut inline = Vec::new();
        let mut search = 0;
        while let Some(p) = code[search..].find("mod ") {
            let at = search + p;
            search = at + 4;
            if at > 0 && ident(code.as_bytes()[at - 1]) {
                continue;
            }
            let after = &code[at + 4..];
            let name_len = after.bytes().take_while(|&c| ident(c)).count();
            if name_len == 0 || !after[name_len..].trim_start().starts_with('{') {
                continue;
            }
            let open = at + 4 + name_len + after[name_len..].find('{').unwrap_or(0);
            let (mut depth, mut j) = (0, open);
            for (k, c) in code[open..].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    j = open + k;
                    break;
                }
            }
            inline.push((open, j));
        }
        // Its child modules, which it may name bare (`child::x`).
        let children: Vec<String> = modules
            .iter()
            .filter(|m| m.len() == me.len() + 1 && m.starts_with(&me))
            .map(|m| m[me.len()].clone())
            .collect();
        for (path, at) in paths(&code, &children) {
            let mut nested = inline.iter().filter(|(a, b)| *a <= at && at < *b).count();
            let (mut base, mut rest): (Module, &[String]) = match path[0].as_str() {
                "crate" => (Vec::new(), &path[1..]),
                _ => (me.clone(), &path[..]),
            };
            while let Some(first) = rest.first() {
                match first.as_str() {
                    "super" if nested > 0 => nested -= 1,
                    "super" => {
                        base.pop();
                    }
                    "self" => {}
                    _ => break,
                }
                rest = &rest[1..];
            }
            let mut to = base;
            for seg in rest {
                let mut next = to.clone();
                next.push(seg.clone());
                if modules.contains(&next) {
                    to = next;
                } else {
                    break;
                }
            }
            if to != me && !to.is_empty() && modules.contains(&to) {
                let line = code[..at].matches('\n').count() + 1;
                out.push(Import {
                    from: me.clone(),
                    to,
                    file: f.clone(),
                    line,
                });
            }
        }
    }
    (modules, out)
}

/// The circles of the import graph (strongly connected components of more than
/// one module).
fn circles(modules: &BTreeSet<Module>, imports: &[Import]) -> Vec<Vec<Module>> {
    let index: HashMap<&Module, usize> = modules.iter().enumerate().map(|(i, m)| (m, i)).collect();
    let names: Vec<&Module> = modules.iter().collect();
    let n = names.len();
    let mut adj = vec![BTreeSet::new(); n];
    for i in imports {
        adj[index[&i.from]].insert(index[&i.to]);
    }
    // Tarjan, iteratively.
    let (mut idx, mut low, mut on) = (vec![usize::MAX; n], vec![0; n], vec![false; n]);
    let (mut stack, mut out, mut counter) = (Vec::new(), Vec::new(), 0);
    for root in 0..n {
        if idx[root] != usize::MAX {
            continue;
        }
        let mut work: Vec<(usize, Vec<usize>)> = vec![(root, adj[root].iter().copied().collect())];
        idx[root] = counter;
        low[root] = counter;
        counter += 1;
        stack.push(root);
        on[root] = true;
        while let Some((v, next)) = work.last_mut() {
            let v = *v;
            if let Some(w) = next.pop() {
                if idx[w] == usize::MAX {
                    idx[w] = counter;
                    low[w] = counter;
                    counter += 1;
                    stack.push(w);
                    on[w] = true;
                    work.push((w, adj[w].iter().copied().collect()));
                } else if on[w] {
                    low[v] = low[v].min(idx[w]);
                }
                continue;
            }
            work.pop();
            if let Some((u, _)) = work.last() {
                low[*u] = low[*u].min(low[v]);
            }
            if low[v] == idx[v] {
                let mut comp = Vec::new();
                while let Some(w) = stack.pop() {
                    on[w] = false;
                    comp.push(names[w].clone());
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
    out
}

/// What is wrong with the crate at `src` against `order`: modules no layer covers,
/// imports upward, circles (but those within one of `known`'s sets of modules).
fn violations(src: &Path, order: &Order, known: &[&[&str]]) -> Vec<String> {
    let (modules, imports) = imports(src);
    let name = |m: &Module| {
        if m.is_empty() {
            "(crate root)".to_string()
        } else {
            m.join("::")
        }
    };
    let mut out = Vec::new();
    for m in modules.iter().filter(|m| !m.is_empty()) {
        if order.layer_of(m).is_none() {
            out.push(format!(
                "module {} is in no declared layer: add it to ARCHITECTURE.md's layers",
                name(m)
            ));
        }
    }
    for i in &imports {
        let (Some((from, fp)), Some((to, tp))) = (order.layer_of(&i.from), order.layer_of(&i.to))
        else {
            continue;
        };
        if to > from {
            out.push(format!(
                "{}:{}: {} (layer {}) imports {} (layer {}, above it): move the code, or \
                 put what both need below both",
                i.file.display(),
                i.line,
                name(&i.from),
                fp.join("::"),
                name(&i.to),
                tp.join("::")
            ));
        }
    }
    for c in circles(&modules, &imports) {
        let names: Vec<String> = c.iter().map(name).collect();
        if known
            .iter()
            .any(|k| names.iter().all(|n| k.contains(&n.as_str())))
        {
            continue;
        }
        let inside: Vec<String> = imports
            .iter()
            .filter(|i| c.contains(&i.from) && c.contains(&i.to))
            .map(|i| {
                format!(
                    "{}:{} ({} → {})",
                    i.file.display(),
                    i.line,
                    name(&i.from),
                    name(&i.to)
                )
            })
            .collect();
        out.push(format!(
            "a circle of imports: {} ({})",
            names.join(", "),
            inside.join("; ")
        ));
    }
    out
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the client crate sits in the workspace")
        .to_path_buf()
}

/// The circles between a folder's `mod.rs` and its children (the parent re-exports
/// or calls a child, the child uses what the parent defines) that were there when
/// the check began to see a child named bare (`child::x`). Each may shrink and
/// leave this list; none may grow, and a new one fails.
const KNOWN_CIRCLES: &[(&str, &[&str])] = &[
    (
        "csd-runtime",
        &["store", "store::read", "store::scrub", "store::write"],
    ),
    (
        "ml-pushdown",
        &[
            "model",
            "model::bert",
            "model::efficientnet",
            "model::exported",
            "model::onnx",
            "model::resnet",
        ],
    ),
    (
        "testbed",
        &[
            "scenario",
            "scenario::nodes",
            "scenario::policy",
            "scenario::sweep",
            "scenario::workload",
        ],
    ),
];

#[test]
fn every_crate_imports_only_down_its_declared_layers() {
    let root = workspace();
    let architecture = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let orders = declared(&architecture);
    let members = [
        "csd-runtime",
        "csd-runtime/protocol",
        "csd-runtime/sandbox",
        "query-pushdown",
        "ml-pushdown",
        "client",
        "client/python",
        "testbed",
    ];
    let mut problems = Vec::new();
    for member in members {
        let Some(order) = orders.get(member) else {
            problems.push(format!("ARCHITECTURE.md declares no layers for {member}"));
            continue;
        };
        let known: Vec<&[&str]> = KNOWN_CIRCLES
            .iter()
            .filter(|(m, _)| *m == member)
            .map(|(_, c)| *c)
            .collect();
        let src = root.join(member).join("src");
        problems.extend(violations(&src, order, &known));
        // A known circle that shrank or went is taken off the list, so it cannot
        // grow back.
        let (modules, imports) = imports(&src);
        let now: Vec<Vec<String>> = circles(&modules, &imports)
            .iter()
            .map(|c| c.iter().map(|m| m.join("::")).collect())
            .collect();
        for k in known {
            if !now
                .iter()
                .any(|c| c.iter().map(String::as_str).eq(k.iter().copied()))
            {
                problems.push(format!(
                    "KNOWN_CIRCLES lists {member}'s {k:?}, which is no longer a circle as \
                     listed (the circles now: {now:?}): shrink or remove the entry"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "the import graph breaks ARCHITECTURE.md's layers:\n{}",
        problems.join("\n")
    );
}

/// The checker itself, on a crate made for it: a clean tree passes; an import up
/// a layer, a circle, and an undeclared module each fail, naming the file.
#[test]
fn the_layer_check_catches_what_it_should() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("high")).unwrap();
    let write = |f: &str, text: &str| std::fs::write(src.join(f), text).unwrap();
    write(
        "lib.rs",
        "mod low;\nmod mid;\nmod high;\npub use low::Thing;\n",
    );
    write(
        "low.rs",
        "pub struct Thing;\n// crate::high::Up in a comment is no import\nconst S: &str = \"crate::high::x\";\n",
    );
    write(
        "mid.rs",
        "use crate::low::Thing;\nuse crate::Thing as Root;\n",
    );
    write("high/mod.rs", "mod part;\nuse super::mid;\n");
    write(
        "high/part.rs",
        "use crate::{low::Thing, mid};\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
    );
    let order = Order::parse("low < mid < high");
    assert_eq!(violations(&src, &order, &[]), Vec::<String>::new());

    // An import up a layer.
    write("low.rs", "pub struct Thing;\nfn f() { crate::mid::g(); }\n");
    let v = violations(&src, &order, &[]);
    assert!(
        v.iter()
            .any(|p| p.contains("low.rs:2") && p.contains("imports mid")),
        "{v:?}"
    );
    // …which is also a circle once mid imports low.
    assert!(
        v.iter()
            .any(|p| p.contains("a circle of imports: low, mid")),
        "{v:?}"
    );
    // A circle within one layer, whether the parent names its child through
    // `self::` or bare (`pub use part::x`).
    write("low.rs", "pub struct Thing;\n");
    write("high/part.rs", "use super::super::high::Other;\n");
    for parent in ["use self::part::x;", "pub use part::x;"] {
        write(
            "high/mod.rs",
            &format!("mod part;\npub struct Other;\n{parent}\n"),
        );
        let v = violations(&src, &order, &[]);
        assert!(
            v.iter()
                .any(|p| p.contains("a circle of imports: high, high::part")),
            "{parent}: {v:?}"
        );
    }
    // A method of that name is no path (`it.part::<T>()`).
    write(
        "high/mod.rs",
        "mod part;\npub struct Other;\nfn f() { it.part::<u8>(); }\n",
    );
    assert_eq!(violations(&src, &order, &[]), Vec::<String>::new());
    // A module no layer covers.
    write("high/mod.rs", "mod part;\n");
    std::fs::write(src.join("stray.rs"), "").unwrap();
    let v = violations(&src, &order, &[]);
    assert!(
        v.iter()
            .any(|p| p.contains("module stray is in no declared layer")),
        "{v:?}"
    );
}

/// A program that only queries nodes (a service using `CsdSession`, a training loop
/// reading features) builds without the node: the protocol crate and the library
/// crates without their default features pull in neither the node nor what only
/// the node needs. One that also runs shipped code at the compute tier (the
/// `wasm` feature) gets the sandbox, wasmtime, and still not the node.
#[test]
fn a_program_that_only_queries_builds_without_the_node() {
    for (package, features) in [
        ("csd-protocol", ""),
        ("csd-query-pushdown", "--no-default-features"),
        ("csd-ml-pushdown", "--no-default-features"),
    ] {
        let tree = dependency_tree(package, features);
        for heavy in ["csd-runtime ", "csd-sandbox ", "wasmtime ", "io-uring "] {
            assert!(
                !tree.lines().any(|l| l.starts_with(heavy)),
                "{package} {features} depends on {heavy}:\n{tree}"
            );
        }
    }
    let features = "--no-default-features --features wasm";
    let tree = dependency_tree("csd-query-pushdown", features);
    assert!(
        tree.lines().any(|l| l.starts_with("wasmtime ")),
        "csd-query-pushdown {features} has no wasmtime:\n{tree}"
    );
    for heavy in ["csd-runtime ", "io-uring "] {
        assert!(
            !tree.lines().any(|l| l.starts_with(heavy)),
            "csd-query-pushdown {features} depends on {heavy}:\n{tree}"
        );
    }
}

/// `cargo tree` of `package`'s normal dependencies with `features`, a crate per line.
fn dependency_tree(package: &str, features: &str) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = std::process::Command::new(&cargo);
    cmd.current_dir(workspace()).args([
        "tree",
        "--offline",
        "-e",
        "normal",
        "--prefix",
        "none",
        "-p",
        package,
    ]);
    cmd.args(features.split_whitespace());
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "cargo tree -p {package} {features}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// ARCHITECTURE.md's code map names every Rust file of the repository (tests,
/// build scripts, fuzz targets, benches, examples and the guest SDK included):
/// each in the section of the folder that holds it (`` ### `FOLDER` ``, the
/// longest), by its name and every folder between (a crate's `src/` aside); a file
/// under no section's folder, anywhere in the document.
#[test]
fn the_code_map_names_every_source_file() {
    let root = workspace();
    let architecture = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let missing = unnamed_files(&root, &architecture);
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md's code map does not name: {}",
        missing.join(", ")
    );
}

/// The code map's sections: folder → its text.
fn code_map_sections(architecture: &str) -> BTreeMap<String, String> {
    let mut sections: BTreeMap<String, String> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in architecture.lines() {
        if let Some(rest) = line.strip_prefix("### `") {
            current = rest.split('`').next().map(String::from);
            continue;
        }
        if line.starts_with("## ") {
            current = None;
        }
        if let Some(c) = &current {
            let s = sections.entry(c.clone()).or_default();
            s.push_str(line);
            s.push('\n');
        }
    }
    sections
}

/// Every `.rs` file under `dir`, build output (`target/`) and hidden folders aside.
fn source_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_dir() {
            if name != "target" && !name.starts_with('.') {
                source_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// The Rust files under `root` that `architecture`'s code map does not name.
fn unnamed_files(root: &Path, architecture: &str) -> Vec<String> {
    let sections = code_map_sections(architecture);
    let mut files = Vec::new();
    source_files(root, &mut files);
    files.sort();
    let mut missing = Vec::new();
    for f in files {
        let rel: Vec<String> = f
            .strip_prefix(root)
            .unwrap()
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let section = sections
            .iter()
            .filter_map(|(folder, text)| {
                let depth = folder.split('/').count();
                let inside = rel.len() > depth
                    && rel[..depth]
                        .iter()
                        .map(String::as_str)
                        .eq(folder.split('/'));
                inside.then_some((depth, text.as_str()))
            })
            .max_by_key(|(depth, _)| *depth);
        let (text, inside) = match section {
            Some((depth, text)) => (text, &rel[depth..]),
            None => (architecture, &rel[..]),
        };
        let parts: Vec<&str> = inside
            .iter()
            .map(String::as_str)
            .filter(|p| *p != "src")
            .collect();
        let Some((name, dirs)) = parts.split_last() else {
            continue;
        };
        let named = (*name == "mod.rs" || text.contains(name))
            && dirs.iter().all(|d| text.contains(&format!("{d}/")));
        if !named {
            missing.push(rel.join("/"));
        }
    }
    missing
}

/// The code map check on a tree made for it: a test file, a build script and a
/// file outside every crate's section each fail until named.
#[test]
fn the_code_map_check_catches_what_it_should() {
    let dir = tempfile::tempdir().unwrap();
    let write = |f: &str| {
        let p = dir.path().join(f);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, "").unwrap();
    };
    write("crate-a/src/lib.rs");
    write("crate-a/src/part/mod.rs");
    write("crate-a/src/part/piece.rs");
    write("target/debug/build/out.rs");
    let map = "## Code map\n### `crate-a`\n`lib.rs`, `part/` (`piece.rs`)\n## Next\n";
    assert_eq!(unnamed_files(dir.path(), map), Vec::<String>::new());
    write("crate-a/tests/it.rs");
    write("crate-a/build.rs");
    write("docs/examples/x/src/main.rs");
    assert_eq!(
        unnamed_files(dir.path(), map),
        [
            "crate-a/build.rs",
            "crate-a/tests/it.rs",
            "docs/examples/x/src/main.rs"
        ]
    );
    let map = "## Code map\n### `crate-a`\n`lib.rs`, `build.rs`, `part/` (`piece.rs`), \
               `tests/` (`it.rs`)\n## Examples\n`docs/examples/x/` (`main.rs`)\n";
    assert_eq!(unnamed_files(dir.path(), map), Vec::<String>::new());
}

/// The files whose code still returns errors as strings (`Result<_, String>`), with
/// how many: each may shrink and leave this list; none may grow, and a new one
/// fails. What is left: clap's value parsers (`client`), the benches' and testbed's
/// own tools, SPDK's bindings and the gateway's static metadata.
const KNOWN_STRING_ERRORS: &[(&str, usize)] = &[
    ("benches/src/bin/mixed.rs", 1),
    ("benches/src/bin/shaped/layout.rs", 1),
    ("benches/src/bin/shaped/workload.rs", 1),
    ("benches/src/bin/store-flight.rs", 1),
    ("benches/src/lib.rs", 1),
    ("client/src/commands/features.rs", 1),
    ("client/src/commands/mod.rs", 1),
    ("client/src/placement.rs", 1),
    ("csd-runtime/protocol/src/bodies.rs", 1),
    ("csd-runtime/protocol/src/stats.rs", 1),
    ("csd-runtime/spdk-sys/src/lib.rs", 1),
    ("csd-runtime/src/device/spdk.rs", 3),
    ("query-pushdown/src/eval/wasm_fn.rs", 1),
    ("query-pushdown/src/gateway/metadata.rs", 3),
    ("testbed/src/scenario/policy.rs", 1),
];

/// How many `Result<…, String>` types `code` (comments and strings blanked) names.
fn string_errors(code: &str) -> usize {
    let b = code.as_bytes();
    let mut n = 0;
    let mut at = 0;
    while let Some(p) = code[at..].find("Result<") {
        let start = at + p;
        at = start + "Result<".len();
        if start > 0 && ident(b[start - 1]) {
            continue;
        }
        // The type's arguments, split at its own top-level commas.
        let (mut depth, mut j, mut last) = (1, at, at);
        while j < b.len() && depth > 0 {
            match b[j] {
                b'<' | b'(' | b'[' => depth += 1,
                b'>' | b')' | b']' => depth -= 1,
                b',' if depth == 1 => last = j + 1,
                _ => {}
            }
            j += 1;
        }
        if last > at && code[last..j.saturating_sub(1)].trim() == "String" {
            n += 1;
        }
    }
    n
}

/// The workspace's library, binary and build code (`src/` of every crate), as
/// workspace-relative paths, with their `Result<_, String>` counts where not 0.
fn string_error_counts(root: &Path) -> BTreeMap<String, usize> {
    let mut files = Vec::new();
    source_files(root, &mut files);
    files
        .into_iter()
        .filter_map(|f| {
            let rel = f.strip_prefix(root).ok()?.to_string_lossy().into_owned();
            if !rel.contains("/src/") || rel.contains("/guest/") || rel.contains("fuzz/") {
                return None;
            }
            let n = string_errors(&code_only(&std::fs::read_to_string(&f).ok()?));
            (n > 0).then_some((rel, n))
        })
        .collect()
}

/// Errors are types: a new `Result<_, String>` in the libraries fails here, naming
/// the file, and one taken away must be taken off [`KNOWN_STRING_ERRORS`].
#[test]
fn string_errors_only_shrink() {
    let now = string_error_counts(&workspace());
    let known: BTreeMap<String, usize> = KNOWN_STRING_ERRORS
        .iter()
        .map(|(f, n)| (f.to_string(), *n))
        .collect();
    let mut problems = Vec::new();
    for (file, &n) in &now {
        match known.get(file) {
            None => problems.push(format!(
                "{file} returns errors as strings ({n} Result<_, String>): give them a type"
            )),
            Some(&k) if n > k => problems.push(format!(
                "{file} has {n} Result<_, String>, {k} before: give the new ones a type"
            )),
            _ => {}
        }
    }
    for (file, &k) in &known {
        let n = now.get(file).copied().unwrap_or(0);
        if n < k {
            problems.push(format!(
                "{file} has {n} Result<_, String> now, KNOWN_STRING_ERRORS says {k}: shrink the entry"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The counter itself: the error type is the last top-level argument.
#[test]
fn the_string_error_count_reads_types() {
    assert_eq!(string_errors("fn f() -> Result<(), String> {}"), 1);
    assert_eq!(
        string_errors("fn f() -> std::result::Result<Vec<(u8, String)>, String> {}"),
        1
    );
    assert_eq!(string_errors("fn f() -> Result<String, Error> {}"), 0);
    assert_eq!(string_errors("fn f() -> Result<String> {}"), 0);
    assert_eq!(string_errors("type R = LazyLock<Result<Data, String>>;"), 1);
    assert_eq!(string_errors("fn f() -> MyResult<(), String> {}"), 0);
    assert_eq!(
        string_errors(&code_only(
            "// Result<(), String>\nconst S: &str = \"Result<(), String>\";"
        )),
        0
    );
}
