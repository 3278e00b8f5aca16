//! The layers of `src/`, read from its `use` lines and paths (comments
//! left out): session → router → lock → upstream → {cluster, tls} →
//! command → {script, protocol} → config, each importing only what is
//! below it, and no circle of imports between top-level modules at all
//! (a circle inside one module is that module's business). A move that
//! points a layer upward fails here with the files that do it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// How far down a top-level module is: a module imports only ones with a
/// smaller rank (unranked modules are held only to "no circle").
fn rank(module: &str) -> Option<u8> {
    Some(match module {
        "session" => 8,
        "router" => 7,
        "lock" => 6,
        "upstream" => 5,
        "cluster" | "tls" => 4,
        "command" => 3,
        "script" | "protocol" => 2,
        "config" => 1,
        _ => return None,
    })
}

/// Top-level module → the modules it names → the files that do.
type Arrows = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

fn arrows() -> Arrows {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Arrows::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src/ reads") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(&root).expect("under src/");
            let first = rel.components().next().expect("a component");
            let top = first.as_os_str().to_string_lossy();
            let top = top.trim_end_matches(".rs").to_string();
            if top == "lib" || top == "main" {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("a source file");
            for named in named_modules(&text) {
                if named != top {
                    out.entry(top.clone())
                        .or_default()
                        .entry(named)
                        .or_default()
                        .insert(rel.display().to_string());
                }
            }
        }
    }
    out
}

/// The top-level modules `text` names as `crate::x` or in `crate::{x, …}`,
/// outside comments.
fn named_modules(text: &str) -> BTreeSet<String> {
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut names = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut rest = &code[..];
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level parts of the group: split on commas at depth 0.
            let mut depth = 0;
            let mut part_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => part_start = true,
                    c if c.is_whitespace() => {}
                    _ if part_start && depth == 0 => {
                        part_start = false;
                        let name = ident(&group[i..]);
                        if !name.is_empty() {
                            names.insert(name);
                        }
                    }
                    _ => {}
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                names.insert(name);
            }
        }
    }
    names
}

#[test]
fn each_layer_imports_only_the_ones_below_it() {
    let mut upward = Vec::new();
    for (from, to) in arrows() {
        for (named, files) in to {
            if let (Some(a), Some(b)) = (rank(&from), rank(&named)) {
                if a <= b {
                    upward.push(format!("{from} → {named}: {files:?}"));
                }
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports that point up or sideways:\n{}",
        upward.join("\n")
    );
}

#[test]
fn no_circle_of_imports_between_top_level_modules() {
    let arrows = arrows();
    // A circle is a path from a module back to itself: search from each.
    let mut circles = Vec::new();
    for start in arrows.keys() {
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        let mut seen = BTreeSet::new();
        while let Some((at, path)) = stack.pop() {
            for next in arrows.get(&at).into_iter().flat_map(|m| m.keys()) {
                if next == start {
                    circles.push(format!("{} → {start}", path.join(" → ")));
                } else if seen.insert(next.clone()) {
                    let mut longer = path.clone();
                    longer.push(next.clone());
                    stack.push((next.clone(), longer));
                }
            }
        }
    }
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_reader_of_imports_sees_both_forms() {
    let text = "use crate::a::b;\n// crate::commented\nuse crate::{c, d::{e, f}, g};\nlet x = crate::h::i();";
    let names: Vec<_> = named_modules(text).into_iter().collect();
    assert_eq!(names, ["a", "c", "d", "g", "h"]);
}
