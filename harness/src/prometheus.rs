//! Reading the Prometheus text the admin listener serves (`/metrics`), as a scraper would: tests
//! check the proxy's counters there, not through accessors on its production types.

/// The value of the series `name` (as exposed: a counter's ends in `_total`) in the Prometheus
/// text `text`, summed over every series whose labels include all of `labels` (none given:
/// every series of `name`). Panics when no series matches, so that a misspelt name or label
/// never reads as a zero.
pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut matched = false;
    let mut sum = 0.0;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, series_labels, value)) = parse_sample(line) else {
            continue;
        };
        let has = |(k, v): &(&str, &str)| series_labels.iter().any(|(sk, sv)| sk == k && sv == v);
        if series == name && labels.iter().all(has) {
            matched = true;
            sum += value
                .parse::<f64>()
                .unwrap_or_else(|e| panic!("the value of {line:?}: {e}"));
        }
    }
    assert!(
        matched,
        "no series {name} with labels {labels:?} in:\n{text}"
    );
    sum
}

/// A series' labels, as (name, value) pairs.
type Labels = Vec<(String, String)>;

/// One sample line: `name{label="value",…} value`, label values with their escapes undone.
fn parse_sample(line: &str) -> Option<(&str, Labels, &str)> {
    let name_end = line.find(['{', ' '])?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(mut inner) = rest.strip_prefix('{') {
        loop {
            if let Some(after) = inner.strip_prefix('}') {
                rest = after;
                break;
            }
            inner = inner.strip_prefix(',').unwrap_or(inner);
            let (key, quoted) = inner.split_once("=\"")?;
            let mut value = String::new();
            let mut chars = quoted.char_indices();
            let end = loop {
                match chars.next()? {
                    (i, '"') => break i,
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        c => value.push(c),
                    },
                    (_, c) => value.push(c),
                }
            };
            labels.push((key.to_owned(), value));
            inner = &quoted[end + 1..];
        }
    }
    let value = rest.split_whitespace().next()?;
    Some((name, labels, value))
}
