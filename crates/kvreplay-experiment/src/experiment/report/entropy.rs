//! The per-layer attention entropy profile of the traces (PyramidKV's funneling).

use super::*;

/// The per-layer attention entropy of each trace's last `window` prompt queries, and its figure.
pub(super) fn entropy_section(
    traces: &[TraceFile],
    window: usize,
    files: &FigureFiles<'_>,
) -> Result<String, SweepError> {
    let entropy = traces
        .iter()
        .map(|trace| {
            let reader = TraceReader::open(&trace.path).map_err(PolicyError::from)?;
            let profile = entropy_profile(&reader, window).map_err(PolicyError::from)?;
            Ok((trace.path.clone(), profile))
        })
        .collect::<Result<Vec<_>, SweepError>>()?;
    let mut out = "\nAttention entropy of the last prompt queries over the prompt, per layer (nats; normalised = / ln(keys attended)):\n\n".to_string();
    let stem = |trace: &Path| {
        trace
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned()
    };
    let hybrid = entropy[0].1.iter().any(|row| row.window > 0);
    let mut headers = vec!["layer".to_string()];
    if hybrid {
        headers.push("attends over".into());
    }
    for (trace, _) in &entropy {
        headers.push(format!("{} entropy", stem(trace)));
        headers.push(format!("{} normalised", stem(trace)));
    }
    let mut table = Table::with_headers(headers);
    for (row_index, first) in entropy[0].1.iter().enumerate() {
        let mut row = vec![first.layer.to_string()];
        if hybrid {
            row.push(layer_kind(first.window));
        }
        for (_, profile) in &entropy {
            row.push(format!("{:.3}", profile[row_index].entropy));
            row.push(format!("{:.3}", profile[row_index].normalized));
        }
        table.push(row);
    }
    out += &table.render(Format::Markdown);
    let series: Vec<Series> = entropy
        .iter()
        .map(|(trace, profile)| {
            (
                stem(trace),
                profile
                    .iter()
                    .map(|l| (l.layer as f64, l.entropy))
                    .collect(),
            )
        })
        .collect();
    let figures = line_chart(
        &files.stem("entropy"),
        "attention entropy per layer",
        "layer",
        "entropy (nats)",
        &series,
        false,
    )?;
    out += &format!(
        "\nFigure: {}.\n",
        figures
            .iter()
            .map(|p| format!("`{}`", p.file_name().unwrap_or_default().to_string_lossy()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(out)
}
