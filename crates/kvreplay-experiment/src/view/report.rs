//! Reports as pages: an experiment's `report.md` as `report.html` beside it, with the same
//! sections (CommonMark with tables, through pulldown-cmark), its tables sortable by a click on a
//! column, and every SVG figure the report lists inlined, so the page stands alone; and
//! `index.html` over every experiment under a results directory.

use super::page::escape;
use pulldown_cmark::{html::push_html, Options, Parser};
use std::io;
use std::path::{Path, PathBuf};

const TEMPLATE: &str = include_str!("report.html");
const SCRIPT: &str = include_str!("report.js");
const STYLE: &str = include_str!("page.css");

/// The page of the report `markdown`, whose figures are files under `dir`.
pub fn report_page(markdown: &str, dir: &Path) -> String {
    let mut body = render(markdown);
    let figures = figures(markdown, dir);
    if !figures.is_empty() {
        body += "<h2 id=\"figures\">Figures</h2>\n";
        for figure in figures {
            body += &figure;
        }
    }
    page(&title(markdown), &body)
}

/// Writes `dir/report.html` from `dir/report.md`; returns its path.
pub fn write_report_page(dir: &Path) -> io::Result<PathBuf> {
    let markdown = std::fs::read_to_string(dir.join("report.md"))?;
    let path = dir.join("report.html");
    crate::atomic::write(&path, report_page(&markdown, dir).as_bytes())?;
    Ok(path)
}

/// The index of every experiment under `results` that has a report: its name, linked to its
/// page, and the report's first paragraph.
pub fn index_page(results: &Path) -> io::Result<String> {
    let mut rows = String::new();
    for dir in experiments(results)? {
        let markdown = std::fs::read_to_string(dir.join("report.md"))?;
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        let name = name.unwrap_or_default();
        rows += &format!(
            "<tr><td><a href=\"{name}/report.html\">{}</a></td><td>{}</td></tr>\n",
            escape(&name),
            escape(&first_paragraph(&markdown))
        );
    }
    let body = format!(
        "<h1>Experiments</h1>\n<table>\n<thead><tr><th>experiment</th><th>what it measures</th></tr></thead>\n<tbody>\n{rows}</tbody>\n</table>\n"
    );
    Ok(page("kvreplay experiments", &body))
}

/// Writes `report.html` for every experiment under `results` and `results/index.html`;
/// returns how many reports.
pub fn write_pages(results: &Path) -> io::Result<usize> {
    let dirs = experiments(results)?;
    for dir in &dirs {
        write_report_page(dir)?;
    }
    crate::atomic::write(&results.join("index.html"), index_page(results)?.as_bytes())?;
    Ok(dirs.len())
}

/// The directories under `results` with a `report.md`, by name.
fn experiments(results: &Path) -> io::Result<Vec<PathBuf>> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(results)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.join("report.md").is_file())
        .collect();
    dirs.sort();
    Ok(dirs)
}

/// CommonMark with tables as HTML.
fn render(markdown: &str) -> String {
    let mut html = String::new();
    push_html(&mut html, Parser::new_ext(markdown, Options::ENABLE_TABLES));
    html
}

/// The SVG figures the report names (`` `name.svg` ``) that exist under `dir`, inlined with
/// their XML prologue dropped; a chart whose data lies beside it (`name.json`) is drawn from
/// it by the page's script, interactive, with the static picture folded below.
fn figures(markdown: &str, dir: &Path) -> Vec<String> {
    markdown
        .split('`')
        .filter(|name| name.ends_with(".svg") && !name.contains('/'))
        .filter_map(|name| {
            let svg = std::fs::read_to_string(dir.join(name)).ok()?;
            let svg = &svg[svg.find("<svg")?..];
            let data = std::fs::read_to_string(dir.join(name).with_extension("json")).ok();
            Some(match data {
                Some(data) => format!(
                    "<figure class=\"chart\"><script type=\"application/json\">{}</script><details><summary>{name} (static)</summary>{svg}</details></figure>\n",
                    data.replace("</", "<\\/")
                ),
                None => format!("<figure>{svg}<figcaption>{name}</figcaption></figure>\n"),
            })
        })
        .collect()
}

/// The report's title: its first `# ` heading.
fn title(markdown: &str) -> String {
    markdown
        .lines()
        .find_map(|line| line.strip_prefix("# "))
        .unwrap_or("kvreplay report")
        .to_owned()
}

/// The first paragraph after the title, on one line.
fn first_paragraph(markdown: &str) -> String {
    markdown
        .split("\n\n")
        .map(str::trim)
        .find(|block| !block.is_empty() && !block.starts_with('#'))
        .unwrap_or("")
        .replace('\n', " ")
}

/// A page of `body` titled `title`.
fn page(title: &str, body: &str) -> String {
    TEMPLATE
        .replace("{{title}}", &escape(title))
        .replace("{{style}}", STYLE)
        .replace("{{script}}", SCRIPT)
        .replace("{{body}}", body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_becomes_a_page_with_its_tables_and_figures() {
        let dir = tempfile::tempdir().unwrap();
        let svg = "<?xml version=\"1.0\"?>\n<svg width=\"10\" height=\"10\"><rect/></svg>";
        std::fs::write(dir.path().join("mass.svg"), svg).unwrap();
        let markdown = "# quick <one>\n\nFour methods.\n\n| policy | mass |\n|---|---|\n| a | 0.5 |\n\nFiles: `runs.csv`, `mass.svg`, `absent.svg`.\n";
        let page = report_page(markdown, dir.path());
        assert!(page.contains("<title>quick &lt;one&gt;</title>"));
        assert!(page.contains("<th>policy</th>") && page.contains("<td>0.5</td>"));
        assert!(page.contains("<figure><svg width=\"10\" height=\"10\"><rect/></svg>"));
        // With its data beside it, the chart is drawn from the data, the picture folded below.
        std::fs::write(dir.path().join("mass.json"), "{\"series\": []}").unwrap();
        let page = report_page(markdown, dir.path());
        assert!(page.contains("<figure class=\"chart\"><script type=\"application/json\">{\"series\": []}</script><details>"));
        assert!(!page.contains("<?xml") && !page.contains("absent.svg</figcaption>"));
    }

    #[test]
    fn the_index_lists_every_report() {
        let results = tempfile::tempdir().unwrap();
        for (name, text) in [("b", "# b\n\nSecond.\n"), ("a", "# a\n\nFirst & best.\n")] {
            std::fs::create_dir(results.path().join(name)).unwrap();
            std::fs::write(results.path().join(name).join("report.md"), text).unwrap();
        }
        std::fs::create_dir(results.path().join("no-report")).unwrap();
        assert_eq!(write_pages(results.path()).unwrap(), 2);
        let index = std::fs::read_to_string(results.path().join("index.html")).unwrap();
        let (a, b) = (
            index.find("a/report.html").unwrap(),
            index.find("b/report.html").unwrap(),
        );
        assert!(a < b && index.contains("First &amp; best.") && !index.contains("no-report"));
        assert!(results.path().join("a/report.html").is_file());
    }
}
