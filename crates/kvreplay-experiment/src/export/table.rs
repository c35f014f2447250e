//! A table of already-formatted cells and its renderings. Column order is the order given, so
//! output is stable and snapshot-testable.

use serde::Serialize;

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// GitHub-flavoured markdown, columns padded.
    Markdown,
    /// RFC 4180 CSV.
    Csv,
    /// JSON.
    Json,
}

impl Format {
    /// Every format with its name (as `--format` takes it) and what it is.
    pub const ALL: [(Format, &'static str, &'static str); 3] = [
        (
            Format::Markdown,
            "markdown",
            "GitHub-flavoured markdown, columns padded",
        ),
        (Format::Csv, "csv", "RFC 4180 CSV"),
        (Format::Json, "json", "JSON"),
    ];
}

/// Headers and rows of text cells.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table with these headers.
    pub fn new<const N: usize>(headers: [&str; N]) -> Self {
        Self {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// An empty table with headers computed at run time.
    pub fn with_headers(headers: Vec<String>) -> Self {
        Self {
            headers,
            rows: Vec::new(),
        }
    }

    /// Appends a row; it must have one cell per header.
    pub fn push(&mut self, row: impl IntoIterator<Item = String>) {
        let row: Vec<String> = row.into_iter().collect();
        assert_eq!(
            row.len(),
            self.headers.len(),
            "row width must match the headers"
        );
        self.rows.push(row);
    }

    /// A copy with a first column `header` holding `value` in every row.
    pub fn prefixed(mut self, header: &str, value: &str) -> Self {
        self.headers.insert(0, header.to_owned());
        for row in &mut self.rows {
            row.insert(0, value.to_owned());
        }
        self
    }

    /// Appends the rows of a table with the same headers.
    pub fn append(&mut self, other: Table) {
        assert_eq!(
            self.headers, other.headers,
            "appended tables must share headers"
        );
        self.rows.extend(other.rows);
    }

    /// Renders the table (JSON: an array of objects keyed by header).
    pub fn render(&self, format: Format) -> String {
        match format {
            Format::Markdown => self.markdown(),
            Format::Csv => self.csv(),
            Format::Json => self.json(),
        }
    }

    fn json(&self) -> String {
        let rows: Vec<serde_json::Map<String, serde_json::Value>> = self
            .rows
            .iter()
            .map(|row| {
                self.headers
                    .iter()
                    .zip(row)
                    .map(|(h, c)| (h.clone(), serde_json::Value::String(c.clone())))
                    .collect()
            })
            .collect();
        serde_json::to_string_pretty(&rows).expect("strings serialise") + "\n"
    }

    fn markdown(&self) -> String {
        let widths: Vec<usize> = (0..self.headers.len())
            .map(|col| {
                self.rows
                    .iter()
                    .map(|row| row[col].chars().count())
                    .chain([self.headers[col].chars().count(), 3])
                    .max()
                    .unwrap_or(3)
            })
            .collect();
        let line = |cells: &[String]| {
            let padded: Vec<String> = cells
                .iter()
                .zip(&widths)
                .map(|(cell, width)| format!("{cell:<width$}"))
                .collect();
            format!("| {} |\n", padded.join(" | "))
        };
        let mut out = line(&self.headers);
        let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
        out += &format!("|-{}-|\n", rule.join("-|-"));
        for row in &self.rows {
            out += &line(row);
        }
        out
    }

    fn csv(&self) -> String {
        let escape = |cell: &String| {
            if cell.contains([',', '"', '\n']) {
                format!("\"{}\"", cell.replace('"', "\"\""))
            } else {
                cell.clone()
            }
        };
        std::iter::once(&self.headers)
            .chain(&self.rows)
            .map(|row| row.iter().map(escape).collect::<Vec<_>>().join(",") + "\n")
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_pads_columns() {
        let mut table = Table::new(["a", "value"]);
        table.push(["long cell".into(), "1".into()]);
        assert_eq!(
            table.render(Format::Markdown),
            "| a         | value |\n|-----------|-------|\n| long cell | 1     |\n"
        );
    }

    #[test]
    fn csv_quotes_what_needs_it() {
        let mut table = Table::new(["x", "y"]);
        table.push(["a,b".into(), "say \"hi\"".into()]);
        assert_eq!(
            table.render(Format::Csv),
            "x,y\n\"a,b\",\"say \"\"hi\"\"\"\n"
        );
    }
}
