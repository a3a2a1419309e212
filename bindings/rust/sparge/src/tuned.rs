//! Reader of the settings files written by `sparge tune` (format: docs/ACCURACY.md, "sparge tune";
//! the Python writer is `sparge.tune`).

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use crate::{Estimator, PredictParams, SelectMode};

/// One layer's tuned prediction settings.
#[derive(Debug, Clone, PartialEq)]
pub struct TunedLayer {
    pub name: String,
    pub heads: usize,
    pub causal: bool,
    pub mode: SelectMode,
    pub sink: bool,
    pub window: i32,
    /// Per query head: top-k fraction (`SelectMode::TopK`) or CDF threshold (`SelectMode::Cdf`).
    pub values: Vec<f32>,
    pub sim_threshold: Vec<f32>,
    pub estimator: Estimator,
    /// What the tuner measured for these settings (metric name, value, density, target).
    pub metric: String,
    pub measured: f64,
    pub density: f64,
    pub target: f64,
}

impl TunedLayer {
    /// Prediction parameters carrying these settings (per-head arrays in host memory: CPU plans,
    /// or copy them to the device for the `_raw` calls).
    pub fn predict_params(&self) -> PredictParams {
        let mut p = PredictParams::default();
        p.mode = self.mode;
        p.attention_sink = Some(self.sink);
        p.local_window = Some(self.window);
        p.estimator = self.estimator;
        match self.mode {
            SelectMode::TopK => p.topk_per_head = Some(self.values.clone()),
            SelectMode::Cdf => p.cdf_threshold_per_head = Some(self.values.clone()),
        }
        p.sim_threshold_per_head = Some(self.sim_threshold.clone());
        p
    }
}

/// A malformed settings file: the line and what is wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct TunedError {
    pub line: usize,
    pub message: String,
}

impl fmt::Display for TunedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

impl std::error::Error for TunedError {}

fn err<T>(line: usize, message: impl Into<String>) -> Result<T, TunedError> {
    Err(TunedError { line, message: message.into() })
}

fn floats(line: usize, what: &str, words: &[&str], n: usize) -> Result<Vec<f32>, TunedError> {
    let v: Result<Vec<f32>, _> = words.iter().map(|w| w.parse::<f32>()).collect();
    let v = match v {
        Ok(v) => v,
        Err(_) => return err(line, format!("{what}: expected numbers")),
    };
    if v.len() != n {
        return err(line, format!("{what} has {} values, expected {n} (heads)", v.len()));
    }
    if v.iter().any(|x| x.is_nan()) {
        return err(line, format!("{what}: NaN"));
    }
    Ok(v)
}

/// Parses the text of a settings file: layers by name.
pub fn parse(text: &str) -> Result<BTreeMap<String, TunedLayer>, TunedError> {
    let lines: Vec<(usize, Vec<&str>)> = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.split('#').next().unwrap_or("").split_whitespace().collect::<Vec<_>>()))
        .filter(|(_, w)| !w.is_empty())
        .collect();
    match lines.first() {
        Some((_, w)) if w.as_slice() == ["sparge-tune", "1"] => {}
        Some((i, _)) => return err(*i, "expected the header 'sparge-tune 1'"),
        None => return err(1, "expected the header 'sparge-tune 1'"),
    }
    let mut out = BTreeMap::new();
    let mut cur: Option<TunedLayer> = None;
    let mut have = (false, false);
    for (i, w) in lines.iter().skip(1) {
        let i = *i;
        match w[0] {
            "layer" => {
                if cur.is_some() {
                    return err(i, "'layer' before the previous layer's 'end'");
                }
                // A layer line without the estimator pair (written before `sparge tune` chose the
                // estimator) means the default of then: mean.
                let mut w = w.clone();
                if w.len() == 12 {
                    w.extend(["estimator", "mean"]);
                }
                let keys: Vec<&str> = w.iter().skip(2).step_by(2).copied().collect();
                if w.len() != 14 || keys != ["heads", "causal", "mode", "sink", "window", "estimator"] {
                    return err(
                        i,
                        "expected 'layer NAME heads H causal 0|1 mode topk|cdf sink 0|1 window W estimator keys_lse|keys_lse_adaptive|keys_lse_split2|mean'",
                    );
                }
                let estimator = match w[13] {
                    "keys_lse" => Estimator::KeysLse,
                    "keys_lse_adaptive" => Estimator::KeysLseAdaptive,
                    "keys_lse_split2" => Estimator::KeysLseSplit2,
                    "mean" => Estimator::Mean,
                    e => return err(i, format!("estimator must be keys_lse, keys_lse_adaptive, keys_lse_split2 or mean, got '{e}'")),
                };
                let int = |s: &str| s.parse::<i64>().ok();
                let (heads, causal, sink, window) = match (int(w[3]), int(w[5]), int(w[9]), int(w[11])) {
                    (Some(a), Some(b), Some(c), Some(d)) => (a, b, c, d),
                    _ => return err(i, "heads, causal, sink and window must be integers"),
                };
                if heads < 1 || !(0..=1).contains(&causal) || !(0..=1).contains(&sink) || !(0..=1024).contains(&window) {
                    return err(i, "heads >= 1, causal and sink 0 or 1, window in [0, 1024] expected");
                }
                let mode = match w[7] {
                    "topk" => SelectMode::TopK,
                    "cdf" => SelectMode::Cdf,
                    m => return err(i, format!("mode must be topk or cdf, got '{m}'")),
                };
                if out.contains_key(w[1]) {
                    return err(i, format!("layer '{}' appears twice", w[1]));
                }
                cur = Some(TunedLayer {
                    name: w[1].to_string(),
                    heads: heads as usize,
                    causal: causal == 1,
                    mode,
                    sink: sink == 1,
                    window: window as i32,
                    values: Vec::new(),
                    sim_threshold: Vec::new(),
                    estimator,
                    metric: String::new(),
                    measured: f64::NAN,
                    density: f64::NAN,
                    target: f64::NAN,
                });
                have = (false, false);
            }
            key => {
                let Some(layer) = cur.as_mut() else {
                    return err(i, format!("'{key}' outside a layer"));
                };
                match key {
                    "topk" | "cdf_threshold" => {
                        let want = if layer.mode == SelectMode::TopK { "topk" } else { "cdf_threshold" };
                        if key != want {
                            return err(i, format!("'{key}' in a layer of mode {}", if want == "topk" { "topk" } else { "cdf" }));
                        }
                        let v = floats(i, key, &w[1..], layer.heads)?;
                        if v.iter().any(|&x| !(x > 0.0 && x <= 1.0)) {
                            return err(i, format!("{key} values must be in (0, 1]"));
                        }
                        layer.values = v;
                        have.0 = true;
                    }
                    "sim_threshold" => {
                        layer.sim_threshold = floats(i, key, &w[1..], layer.heads)?;
                        have.1 = true;
                    }
                    "measured" => {
                        if w.len() != 7 || w[3] != "density" || w[5] != "target" || !(w[1] == "rel_l1" || w[1] == "cosine") {
                            return err(i, "expected 'measured rel_l1|cosine V density V target V'");
                        }
                        let f = |s: &str| s.parse::<f64>().unwrap_or(f64::NAN);
                        layer.metric = w[1].to_string();
                        layer.measured = f(w[2]);
                        layer.density = f(w[4]);
                        layer.target = f(w[6]);
                    }
                    "end" => {
                        if !(have.0 && have.1) {
                            return err(i, format!("layer '{}' lacks its per-head values", layer.name));
                        }
                        let l = cur.take().unwrap();
                        out.insert(l.name.clone(), l);
                    }
                    other => return err(i, format!("unknown item '{other}'")),
                }
            }
        }
    }
    if let Some(l) = cur {
        return err(lines.last().map_or(1, |x| x.0), format!("layer '{}' has no 'end'", l.name));
    }
    Ok(out)
}

/// Reads a settings file written by `sparge tune`.
pub fn load(path: impl AsRef<Path>) -> Result<BTreeMap<String, TunedLayer>, Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(path)?;
    Ok(parse(&text)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "sparge-tune 1\n# comment\nlayer L0 heads 2 causal 1 mode cdf sink 1 window 2 estimator keys_lse\n\
        cdf_threshold 0.9 0.95\nsim_threshold -0.1 0.5\nmeasured rel_l1 0.05 density 0.3 target 0.06\nend\n";

    #[test]
    fn parses_a_layer() {
        let m = parse(GOOD).unwrap();
        let l = &m["L0"];
        assert_eq!(l.heads, 2);
        assert!(l.causal && l.sink);
        assert_eq!(l.window, 2);
        assert_eq!(l.mode, SelectMode::Cdf);
        assert_eq!(l.values, vec![0.9, 0.95]);
        assert_eq!(l.sim_threshold, vec![-0.1, 0.5]);
        let p = l.predict_params();
        assert_eq!(p.cdf_threshold_per_head, Some(vec![0.9, 0.95]));
        assert_eq!(p.local_window, Some(2));
        assert_eq!(p.attention_sink, Some(true));
        assert_eq!(p.estimator, Estimator::KeysLse);
        assert_eq!(p.to_raw().estimator, crate::sys::SPARGE_ESTIMATOR_KEYS_LSE);
    }

    #[test]
    fn reads_the_split2_estimator() {
        let m = parse(&GOOD.replace("estimator keys_lse", "estimator keys_lse_split2")).unwrap();
        assert_eq!(m["L0"].estimator, Estimator::KeysLseSplit2);
        assert_eq!(m["L0"].predict_params().to_raw().estimator, crate::sys::SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2);
    }

    #[test]
    fn reads_the_adaptive_estimator() {
        let m = parse(&GOOD.replace("estimator keys_lse", "estimator keys_lse_adaptive")).unwrap();
        assert_eq!(m["L0"].estimator, Estimator::KeysLseAdaptive);
        assert_eq!(m["L0"].predict_params().to_raw().estimator, crate::sys::SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE);
    }

    #[test]
    fn a_layer_line_without_estimator_means_mean() {
        let m = parse(&GOOD.replace(" estimator keys_lse", "")).unwrap();
        assert_eq!(m["L0"].estimator, Estimator::Mean);
        assert_eq!(m["L0"].predict_params().to_raw().estimator, crate::sys::SPARGE_ESTIMATOR_MEAN);
    }

    #[test]
    fn rejects_malformed_files() {
        for (bad, needle) in [
            ("sparge-tune 2\n", "header"),
            (GOOD.replace("cdf_threshold 0.9 0.95", "cdf_threshold 0.9").as_str(), "expected 2"),
            (GOOD.replace("0.95\n", "1.5\n").as_str(), "(0, 1]"),
            (GOOD.replace("window 2", "window x").as_str(), "integers"),
            (GOOD.replace("end\n", "").as_str(), "no 'end'"),
            (GOOD.replace("cdf_threshold", "topk").as_str(), "mode cdf"),
            (GOOD.replace("keys_lse", "max").as_str(), "estimator must be"),
            (GOOD.replace(" estimator keys_lse", " estimator").as_str(), "expected 'layer"),
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.message.contains(needle), "{bad:?}: {e}");
        }
    }
}
