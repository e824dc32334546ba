//! `--full`: greedy outputs of completed requests, compared across the cases. Every case sends
//! the same prompts (client `w`, request `n`), so a prompt completed in a fault case is compared
//! with the fault-free `baseline`'s text for it, or, when the baseline did not get that far,
//! with the first case that completed it. Cases ask for different lengths (16 or 48 tokens), so
//! two texts agree when one is a prefix of the other. A fault may fail a request; it must never
//! change what a completed one says.

use crate::drive::Row;
use std::collections::HashMap;

pub fn compare(rows: &mut [Row]) {
    let baseline: HashMap<String, String> = rows
        .iter()
        .find(|r| r.name == "baseline")
        .map(|r| r.texts.iter().cloned().collect())
        .unwrap_or_default();
    let mut first_seen: HashMap<String, (String, String)> = HashMap::new();
    for r in rows.iter_mut() {
        if r.name == "baseline" {
            r.claims
                .push(format!("greedy: {} texts recorded", r.texts.len()));
            continue;
        }
        let (mut same_base, mut same_other, mut differ) = (0usize, 0usize, Vec::new());
        for (prompt, text) in &r.texts {
            let want = match baseline.get(prompt) {
                Some(t) => Some((t, "baseline")),
                None => first_seen.get(prompt).map(|(t, case)| (t, case.as_str())),
            };
            match want {
                Some((t, from)) if t.starts_with(text.as_str()) || text.starts_with(t.as_str()) => {
                    if from == "baseline" {
                        same_base += 1;
                    } else {
                        same_other += 1;
                    }
                }
                Some((t, from)) => {
                    differ.push(format!("{prompt:?}: {text:?} here, {t:?} in {from}"))
                }
                None => {
                    first_seen.insert(prompt.clone(), (text.clone(), r.name.clone()));
                }
            }
        }
        r.claims.push(format!(
            "greedy: {same_base} same as baseline, {same_other} same as another case, {} differ",
            differ.len()
        ));
        if let Some(first) = differ.first() {
            r.problems.push(format!(
                "{} completed requests' greedy text differs, e.g. {first}",
                differ.len()
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, texts: &[(&str, &str)]) -> Row {
        Row {
            name: name.into(),
            texts: texts
                .iter()
                .map(|(p, t)| (p.to_string(), t.to_string()))
                .collect(),
            ..Row::default()
        }
    }

    #[test]
    fn texts_are_compared_with_the_baseline_then_across_cases() {
        let mut rows = vec![
            row("baseline", &[("a", "1"), ("b", "2")]),
            row("x", &[("a", "1"), ("c", "3")]),
            row("y", &[("b", "2"), ("c", "3")]),
            row("z", &[("a", "9"), ("c", "3")]),
            // A longer run of the same greedy text agrees.
            row("w", &[("a", "1 and more"), ("b", "2")]),
        ];
        compare(&mut rows);
        assert!(
            rows[1].passed() && rows[2].passed(),
            "{:?}",
            rows[2].problems
        );
        assert!(rows[2].claims[0].contains("1 same as baseline, 1 same as another case"));
        assert!(!rows[3].passed());
        assert!(
            rows[3].problems[0].contains("\"a\""),
            "{:?}",
            rows[3].problems
        );
    }
}
