// CPU-backend tests of the safe API against a naive float64 reference.
use sparge::{DType, Device, Estimator, Plan, PredictParams, Precision, Problem, SelectMode, Status};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

fn exact_problem(b: i64, hq: i64, hkv: i64, lq: i64, lkv: i64, d: i64, causal: bool) -> Problem {
    Problem::new(b, hq, hkv, lq, lkv, d).dtype(DType::F32).device(Device::Cpu).precision(Precision::Exact).causal(causal)
}

/// Softmax attention in f64 over the keys the mask and the causal rule allow.
/// Returns (out, lse); rows with no key give zeros and -inf.
fn reference(p: &Problem, q: &[f32], k: &[f32], v: &[f32], mask: Option<&[u8]>) -> (Vec<f64>, Vec<f64>) {
    let (b_, hq, hkv, lq, lkv, d) =
        (p.batch as usize, p.heads_q as usize, p.heads_kv as usize, p.len_q as usize, p.len_kv as usize, p.head_dim as usize);
    let (bq, bk) = (if p.block_q > 0 { p.block_q as usize } else { 128 }, if p.block_k > 0 { p.block_k as usize } else { 64 });
    let (nqb, nkb) = ((lq + bq - 1) / bq, (lkv + bk - 1) / bk);
    let scale = if p.scale > 0.0 { p.scale as f64 } else { 1.0 / (d as f64).sqrt() };
    let mut out = vec![0f64; b_ * hq * lq * d];
    let mut lse = vec![f64::NEG_INFINITY; b_ * hq * lq];
    for b in 0..b_ {
        for h in 0..hq {
            let hk = h / (hq / hkv);
            for i in 0..lq {
                let qr = &q[((b * hq + h) * lq + i) * d..][..d];
                let mut s = Vec::new();
                for j in 0..lkv {
                    if p.causal && (j as i64) > i as i64 + (lkv as i64 - lq as i64) {
                        continue;
                    }
                    if let Some(m) = mask {
                        if m[((b * hq + h) * nqb + i / bq) * nkb + j / bk] == 0 {
                            continue;
                        }
                    }
                    let kr = &k[((b * hkv + hk) * lkv + j) * d..][..d];
                    let dot: f64 = qr.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum();
                    s.push((j, dot * scale));
                }
                if s.is_empty() {
                    continue;
                }
                let m = s.iter().fold(f64::NEG_INFINITY, |a, x| a.max(x.1));
                let l: f64 = s.iter().map(|x| (x.1 - m).exp()).sum();
                let o = &mut out[((b * hq + h) * lq + i) * d..][..d];
                for (j, sj) in &s {
                    let w = (sj - m).exp() / l;
                    let vr = &v[((b * hkv + hk) * lkv + j) * d..][..d];
                    for c in 0..d {
                        o[c] += w * vr[c] as f64;
                    }
                }
                lse[(b * hq + h) * lq + i] = m + l.ln();
            }
        }
    }
    (out, lse)
}

fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()).fold(0.0, f64::max)
}

fn cosine(a: &[f32], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * y).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn version_and_backend_query() {
    assert_eq!(sparge::version(), (0, 1, 0));
    let _ = sparge::has_cuda(); // either answer is valid; the call must work
}

#[test]
fn plan_resolves_defaults_and_sizes_its_workspace() {
    let plan = Plan::new(&exact_problem(2, 4, 2, 300, 200, 32, true)).expect("plan");
    let p = plan.problem();
    assert_eq!((p.block_q, p.block_k), (128, 64));
    assert!((p.scale - 1.0 / 32f32.sqrt()).abs() < 1e-6);
    assert!(plan.workspace_size().expect("workspace size") > 0);
    assert_eq!(plan.mask_shape(), [2, 4, 3, 4]);
    // Causal, bottom-right aligned: Lkv - Lq = -100, so query block 0 (rows
    // 0..127) sees keys 0..27 (1 block), block 1 sees up to key 155 (3 blocks),
    // block 2 (rows 256..299) up to key 199 (4 blocks).
    assert_eq!(plan.visible_blocks().expect("visible"), 1 + 3 + 4);
    let k = plan.kernel_info().expect("kernel info");
    assert_eq!(k.family, "cpu");
    // EXACT has no online softmax (two float64 passes over a row): no step.
    assert_eq!((k.head_dim, k.block_q, k.keys_per_step), (32, 128, 0));
}

#[test]
fn dense_attention_matches_float64_reference() {
    let prob = exact_problem(1, 4, 2, 200, 333, 24, false);
    let plan = Plan::new(&prob).unwrap();
    let mut r = Rng(7);
    let (q, k, v) = (r.vec(4 * 200 * 24), r.vec(2 * 333 * 24), r.vec(2 * 333 * 24));
    let ms = plan.mask_shape();
    let ones = vec![1u8; ms.iter().product::<i64>() as usize];
    let mut out = vec![0f32; q.len()];
    let mut lse = vec![0f32; 4 * 200];
    plan.attention(&q, &k, &v, Some(&ones), None, &mut out, Some(&mut lse)).unwrap();
    let (ref_out, ref_lse) = reference(plan.problem(), &q, &k, &v, None);
    assert!(max_abs_diff(&out, &ref_out) < 1e-5, "max diff {}", max_abs_diff(&out, &ref_out));
    assert!(max_abs_diff(&lse, &ref_lse) < 1e-4);
}

#[test]
fn causal_attention_with_empty_rows_matches_reference() {
    // Lq > Lkv: the first Lq - Lkv query rows see no key (zeros, LSE -inf).
    let plan = Plan::new(&exact_problem(1, 2, 1, 260, 150, 16, true)).unwrap();
    let mut r = Rng(11);
    let (q, k, v) = (r.vec(2 * 260 * 16), r.vec(150 * 16), r.vec(150 * 16));
    let ones = vec![1u8; plan.mask_shape().iter().product::<i64>() as usize];
    let mut out = vec![1f32; q.len()];
    let mut lse = vec![0f32; 2 * 260];
    plan.attention(&q, &k, &v, Some(&ones), None, &mut out, Some(&mut lse)).unwrap();
    let (ref_out, _) = reference(plan.problem(), &q, &k, &v, None);
    assert!(max_abs_diff(&out, &ref_out) < 1e-5);
    assert!(lse[0].is_infinite() && lse[0] < 0.0);
    assert!(out[..16].iter().all(|x| *x == 0.0));
}

#[test]
fn predicted_mask_is_used_and_counted() {
    let plan = Plan::new(&exact_problem(1, 2, 2, 512, 512, 32, false)).unwrap();
    let mut r = Rng(3);
    let (q, k, v) = (r.vec(2 * 512 * 32), r.vec(2 * 512 * 32), r.vec(2 * 512 * 32));
    let ms = plan.mask_shape();
    let mut mask = vec![0u8; ms.iter().product::<i64>() as usize];
    let mut kept = vec![0i32; 2];
    let params = PredictParams { topk: 0.5, ..Default::default() };
    plan.predict_mask(&q, &k, Some(&params), &mut mask, Some(&mut kept)).unwrap();
    // 4 query blocks x 8 key blocks per head; top-k keeps floor(0.5 * 8) = 4 per row.
    let per_head: Vec<i32> = mask.chunks(32).map(|c| c.iter().map(|x| *x as i32).sum()).collect();
    assert_eq!(per_head, kept);
    assert!(kept.iter().all(|&n| n == 16), "kept {kept:?}");
    // attention with mask None predicts the same mask inside.
    let mut out = vec![0f32; q.len()];
    plan.attention(&q, &k, &v, None, Some(&params), &mut out, None).unwrap();
    let (ref_out, _) = reference(plan.problem(), &q, &k, &v, Some(&mask));
    assert!(max_abs_diff(&out, &ref_out) < 1e-5);
}

#[test]
fn the_default_estimator_is_auto() {
    let d = PredictParams::default();
    assert_eq!(d.estimator, Estimator::Auto);
    assert_eq!(Estimator::default(), Estimator::Auto);
    assert_eq!(d.to_raw().estimator, sparge::sys::SPARGE_ESTIMATOR_AUTO);
    assert_eq!(sparge::sys::sparge_predict_params_t::default().estimator, sparge::sys::SPARGE_ESTIMATOR_AUTO);
    // One query block (every row 4 e0, scale 1/2: one direction, so Auto's KeysLseAdaptive keeps it whole)
    // against eight key blocks: block 1 holds one key 5 e0 and 63 keys -e0 (per-key log-sum-exp ~10, mean
    // score -1.8), block 2 64 keys e0 (log-sum-exp 6.2, mean score 2), the others zeros. The default sink
    // keeps block 0, the default non-causal window 1 the diagonal blocks 6 and 7 (rows aligned to the last
    // keys), top-k 0.5 one more: block 1 for KeysLse, block 2 for Mean. No parameters and the default ones
    // predict the KeysLse mask.
    let plan = Plan::new(&exact_problem(1, 1, 1, 128, 512, 4, false)).unwrap();
    let q: Vec<f32> = (0..128 * 4).map(|i| if i % 4 == 0 { 4.0 } else { 0.0 }).collect();
    let k: Vec<f32> = (0..512 * 4)
        .map(|i| match (i / 4, i % 4) {
            (64, 0) => 5.0,
            (65..=127, 0) => -1.0,
            (128..=191, 0) => 1.0,
            _ => 0.0,
        })
        .collect();
    let predict = |p: Option<&PredictParams>| {
        let mut m = vec![0u8; 8];
        plan.predict_mask(&q, &k, p, &mut m, None).unwrap();
        m
    };
    let lse = predict(Some(&PredictParams { estimator: Estimator::KeysLse, ..Default::default() }));
    assert_eq!(lse, vec![1, 1, 0, 0, 0, 0, 1, 1]);
    assert_eq!(predict(Some(&PredictParams { estimator: Estimator::Mean, ..Default::default() })),
               vec![1, 0, 1, 0, 0, 0, 1, 1]);
    assert_eq!(predict(Some(&PredictParams::default())), lse);
    assert_eq!(predict(None), lse);
}

// The plan, query block and keys of keys_lse_split2_keeps_both_groups_blocks (described there).
fn two_group_block() -> (Plan, Vec<f32>, Vec<f32>) {
    let plan = Plan::new(&exact_problem(1, 1, 1, 128, 256, 4, false)).unwrap();
    let q: Vec<f32> = (0..128 * 4).map(|i| if i % 4 == usize::from(i / 4 >= 64) { 4.0 } else { 0.0 }).collect();
    let k: Vec<f32> = (0..256 * 4)
        .map(|i| match (i / 4, i % 4) {
            (64..=127, 0) => 1.5,
            (128..=191, 1) => 1.5,
            (192..=255, 0 | 1) => 1.0,
            _ => 0.0,
        })
        .collect();
    (plan, q, k)
}

#[test]
fn keys_lse_split2_keeps_both_groups_blocks() {
    // One query block of two row groups (rows 0..63: 4 e0, rows 64..127: 4 e1; scale 1/2) against
    // four key blocks: 0 zeros (the sink), 1 holds 1.5 e0, 2 holds 1.5 e1, 3 holds e0 + e1. The pooled
    // row 2 e0 + 2 e1 ranks block 3 first (KeysLse); each group's own block mass is 0.68 on its block
    // and 0.25 on block 3, so their average ranks blocks 1 and 2 above block 3 (KeysLseSplit2). No local
    // window (the default one would keep the diagonal blocks 2 and 3).
    let (plan, q, k) = two_group_block();
    let predict = |e: Estimator| {
        let mut m = vec![0u8; 4];
        let p = PredictParams { estimator: e, topk: 0.75, local_window: Some(0), ..Default::default() };
        plan.predict_mask(&q, &k, Some(&p), &mut m, None).unwrap();
        m
    };
    assert_eq!(predict(Estimator::KeysLse), vec![1, 1, 0, 1]);
    assert_eq!(predict(Estimator::KeysLseSplit2), vec![1, 1, 1, 0]);
    assert_eq!(PredictParams { estimator: Estimator::KeysLseSplit2, ..Default::default() }.to_raw().estimator,
               sparge::sys::SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2);
}

#[test]
fn keys_lse_adaptive_splits_only_short_mean_blocks() {
    // The query block and keys of keys_lse_split2_keeps_both_groups_blocks. Its rows point apart, its mean
    // row short but not near zero (0.25 * 4 <= |mean| = 2 sqrt 2 < 0.75 * 4): KeysLseAdaptive splits it as
    // KeysLseSplit2. With 4 e2 added to every row (no key has an e2 part: the same scores, the same two
    // groups) the mean row is long (sqrt 24 >= 0.75 sqrt 32): the block keeps its one pooled row, as KeysLse.
    let (plan, q, k) = two_group_block();
    let q_long: Vec<f32> = q.iter().enumerate().map(|(i, &x)| if i % 4 == 2 { 4.0 } else { x }).collect();
    let predict = |q: &[f32], e: Estimator| {
        let mut m = vec![0u8; 4];
        let p = PredictParams { estimator: e, topk: 0.75, local_window: Some(0), ..Default::default() };
        plan.predict_mask(q, &k, Some(&p), &mut m, None).unwrap();
        m
    };
    assert_eq!(predict(&q, Estimator::KeysLseAdaptive), vec![1, 1, 1, 0]);
    assert_eq!(predict(&q_long, Estimator::KeysLseSplit2), vec![1, 1, 1, 0]);
    assert_eq!(predict(&q_long, Estimator::KeysLse), vec![1, 1, 0, 1]);
    assert_eq!(predict(&q_long, Estimator::KeysLseAdaptive), vec![1, 1, 0, 1]);
    assert_eq!(PredictParams { estimator: Estimator::KeysLseAdaptive, ..Default::default() }.to_raw().estimator,
               sparge::sys::SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE);
}

#[test]
fn auto_is_keys_lse_adaptive_when_not_causal_and_keys_lse_when_causal() {
    // The query block and keys of keys_lse_split2_keeps_both_groups_blocks (its rows point apart: the
    // block splits), no local window, top-k 0.75. Not causal: KeysLse keeps block 3, KeysLseAdaptive block 2
    // (the sink keeps block 0, the ranking two more). Causal (query i sees keys up to i + 128): the first
    // diagonal block 2 is forced, and the ranking's one more is block 3 for KeysLse, block 1 for
    // KeysLseAdaptive. Auto, named or the default, predicts the mode's estimator's mask.
    let (plan, q, k) = two_group_block();
    let causal_plan = Plan::new(&exact_problem(1, 1, 1, 128, 256, 4, true)).unwrap();
    for (plan, causal) in [(&plan, false), (&causal_plan, true)] {
        let predict = |e: Estimator| {
            let mut m = vec![0u8; 4];
            let p = PredictParams { estimator: e, topk: 0.75, local_window: Some(0), ..Default::default() };
            plan.predict_mask(&q, &k, Some(&p), &mut m, None).unwrap();
            m
        };
        let (lse, adaptive) = (predict(Estimator::KeysLse), predict(Estimator::KeysLseAdaptive));
        if causal {
            assert_eq!((&lse, &adaptive), (&vec![1, 0, 1, 1], &vec![1, 1, 1, 0]));
        } else {
            assert_eq!((&lse, &adaptive), (&vec![1, 1, 0, 1], &vec![1, 1, 1, 0]));
        }
        let want = if causal { lse } else { adaptive };
        assert_eq!(predict(Estimator::Auto), want, "causal {causal}");
        let mut m = vec![0u8; 4];
        let p = PredictParams { topk: 0.75, local_window: Some(0), ..Default::default() };
        plan.predict_mask(&q, &k, Some(&p), &mut m, None).unwrap();
        assert_eq!(m, want, "default, causal {causal}");
    }
}

#[test]
fn keys_lse_adaptive_keeps_noise_blocks_whole() {
    // Independent uniform random rows: every block's mean row is near zero (about 1/sqrt(128) of the rows'
    // length, below 0.25 of it), so no block splits: KeysLseAdaptive's masks are KeysLse's, unlike
    // KeysLseSplit2's (the rows scaled by 8: with small scores the two rules rank the blocks alike to first
    // order).
    let (hq, l, d) = (2, 1024, 64);
    let plan = Plan::new(&exact_problem(1, hq, 1, l, l, d, false)).unwrap();
    let mut r = Rng(17);
    let q: Vec<f32> = r.vec((hq * l * d) as usize).iter().map(|x| 8.0 * x).collect();
    let k = r.vec((l * d) as usize);
    let n = plan.mask_shape().iter().product::<i64>() as usize;
    let predict = |e: Estimator, mode: SelectMode| {
        let mut m = vec![0u8; n];
        let p = PredictParams { estimator: e, mode, topk: 0.25, cdf_threshold: 0.5, ..Default::default() };
        plan.predict_mask(&q, &k, Some(&p), &mut m, None).unwrap();
        m
    };
    for mode in [SelectMode::TopK, SelectMode::Cdf] {
        let lse = predict(Estimator::KeysLse, mode);
        assert_eq!(predict(Estimator::KeysLseAdaptive, mode), lse);
        assert_ne!(predict(Estimator::KeysLseSplit2, mode), lse);
    }
}

#[test]
fn cdf_mode_and_per_head_topk() {
    let plan = Plan::new(&exact_problem(1, 2, 1, 256, 512, 16, false)).unwrap();
    let mut r = Rng(5);
    let (q, k) = (r.vec(2 * 256 * 16), r.vec(512 * 16));
    let mut mask = vec![0u8; plan.mask_shape().iter().product::<i64>() as usize];
    let mut kept = vec![0i32; 2];
    let params = PredictParams { topk_per_head: Some(vec![1.0, 0.25]), local_window: Some(0), ..Default::default() };
    plan.predict_mask(&q, &k, Some(&params), &mut mask, Some(&mut kept)).unwrap();
    assert_eq!(kept, vec![2 * 8, 2 * 2]);
    // the default window (1, not causal: the two diagonal blocks) and the sink count in the budget: 3 > 0.25 * 8
    let params = PredictParams { topk_per_head: Some(vec![1.0, 0.25]), ..Default::default() };
    plan.predict_mask(&q, &k, Some(&params), &mut mask, Some(&mut kept)).unwrap();
    assert_eq!(kept, vec![2 * 8, 2 * 3]);
    let cdf = PredictParams { mode: SelectMode::Cdf, cdf_threshold: 1.0, ..Default::default() };
    plan.predict_mask(&q, &k, Some(&cdf), &mut mask, Some(&mut kept)).unwrap();
    assert!(kept.iter().all(|&n| n >= 2 && n <= 16), "kept {kept:?}");
}

#[test]
fn int8_fp8_precision_is_close_to_reference() {
    let prob = Problem::new(1, 2, 2, 256, 256, 64).dtype(DType::F32).precision(Precision::Int8Fp8);
    let plan = Plan::new(&prob).unwrap();
    let mut r = Rng(9);
    let (q, k, v) = (r.vec(2 * 256 * 64), r.vec(2 * 256 * 64), r.vec(2 * 256 * 64));
    let ones = vec![1u8; plan.mask_shape().iter().product::<i64>() as usize];
    let mut out = vec![0f32; q.len()];
    plan.attention(&q, &k, &v, Some(&ones), None, &mut out, None).unwrap();
    let (ref_out, _) = reference(plan.problem(), &q, &k, &v, None);
    assert!(cosine(&out, &ref_out) > 0.995, "cos {}", cosine(&out, &ref_out));
}

fn rel_l1(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()).sum();
    num / b.iter().map(|y| y.abs()).sum::<f64>()
}

/// rel-L1 against the float64 reference of INT8_FP8 and of `other` on the same
/// random inputs (all blocks kept, 1024 keys), after a cosine check of each.
fn rel_l1_int8_fp8_and(other: Precision, seed: u64, other_cos: f64) -> (f64, f64) {
    let (hq, lq, lkv, d) = (2usize, 128usize, 1024usize, 64usize);
    let mut r = Rng(seed);
    let (q, k, v) = (r.vec(hq * lq * d), r.vec(hq * lkv * d), r.vec(hq * lkv * d));
    let mut err = Vec::new();
    for (precision, bar) in [(Precision::Int8Fp8, 0.995), (other, other_cos)] {
        let prob = Problem::new(1, hq as i64, hq as i64, lq as i64, lkv as i64, d as i64).dtype(DType::F32).precision(precision);
        let plan = Plan::new(&prob).unwrap();
        assert_eq!(plan.problem().precision, precision);
        let ones = vec![1u8; plan.mask_shape().iter().product::<i64>() as usize];
        let mut out = vec![0f32; q.len()];
        plan.attention(&q, &k, &v, Some(&ones), None, &mut out, None).unwrap();
        let (ref_out, _) = reference(plan.problem(), &q, &k, &v, None);
        assert!(cosine(&out, &ref_out) > bar, "{precision:?}: cos {}", cosine(&out, &ref_out));
        err.push(rel_l1(&out, &ref_out));
    }
    eprintln!("rel-L1 int8_fp8 {:.4} vs {other:?} {:.4}", err[0], err[1]);
    (err[0], err[1])
}

#[test]
fn int8_fp8_split_v_precision_is_closer_to_reference_than_int8_fp8() {
    // V as hi + lo: the fp8 rounding of V, the larger part of the error on long rows, shrinks.
    let (e8, es) = rel_l1_int8_fp8_and(Precision::Int8Fp8SplitV, 11, 0.995);
    assert!(es < 0.9 * e8, "rel-L1 int8_fp8 {e8} vs int8_fp8_split_v {es}");
}

#[test]
fn int8_fp16_precision_is_closer_to_reference_than_int8_fp8() {
    // P and V without fp8 rounding: only the int8 Q.K^T error is left.
    let (e8, e16) = rel_l1_int8_fp8_and(Precision::Int8Fp16, 13, 0.9995);
    assert!(e16 < 0.02, "rel-L1 int8_fp16 {e16}");
    assert!(e16 < 0.5 * e8, "rel-L1 int8_fp8 {e8} vs int8_fp16 {e16}");
}

#[test]
fn bad_inputs_are_errors_with_messages() {
    // Hq not a multiple of Hkv: rejected by the library.
    let e = Plan::new(&exact_problem(1, 3, 2, 64, 64, 16, false)).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(!e.message().is_empty());
    assert!(e.to_string().contains(e.message()));

    // Zero length, as SPARGE_PROBLEM_INIT leaves it: the message names len_q.
    let e = Plan::new(&exact_problem(1, 1, 1, 0, 64, 16, false)).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("len_q"), "{}", e.message());

    let plan = Plan::new(&exact_problem(1, 1, 1, 64, 64, 16, false)).unwrap();
    let x = vec![0.5f32; 64 * 16];
    let mut out = vec![0f32; 64 * 16];

    // topk outside (0, 1]: the library says which parameter.
    let bad = PredictParams { topk: 1.5, ..Default::default() };
    let e = plan.attention(&x, &x, &x, None, Some(&bad), &mut out, None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("topk"), "{}", e.message());

    // pv_threshold > 0 has no Exact form; NaN, negative and infinite values are invalid.
    let pv = PredictParams { pv_threshold: 1.0, ..Default::default() };
    let e = plan.attention(&x, &x, &x, None, Some(&pv), &mut out, None).unwrap_err();
    assert_eq!(e.status(), Status::Unsupported);
    assert!(e.message().contains("params->pv_threshold"), "{}", e.message());
    for bad in [f32::NAN, -1.0, f32::INFINITY] {
        let pv = PredictParams { pv_threshold: bad, ..Default::default() };
        let e = plan.attention(&x, &x, &x, None, Some(&pv), &mut out, None).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        assert!(e.message().contains("params->pv_threshold"), "{}", e.message());
    }

    // Wrong slice length: caught on the Rust side, before any pointer crosses.
    let e = plan.attention(&x[1..], &x, &x, None, None, &mut out, None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().starts_with("q:"), "{}", e.message());

    // Per-head vector of the wrong length.
    let ph = PredictParams { topk_per_head: Some(vec![0.5, 0.5]), ..Default::default() };
    assert!(plan.attention(&x, &x, &x, None, Some(&ph), &mut out, None).is_err());

    // A successful call clears nothing it should not: the plan still works.
    plan.attention(&x, &x, &x, None, None, &mut out, None).unwrap();
}

#[test]
fn pv_skip_drops_the_steps_far_below_the_running_max() {
    // Every query and the first 64 keys share a direction u, so those keys score about 12 nats above
    // the others: with pv_threshold 1 every later step of a row is skipped, and the result is that of
    // a mask keeping only the first step (the FP16 mode steps one 64-key block at a time on the CPU);
    // with pv_threshold 60 nothing is skipped.
    let (hq, lq, lkv, d) = (2usize, 128usize, 512usize, 64usize);
    let prob = Problem::new(1, hq as i64, hq as i64, lq as i64, lkv as i64, d as i64)
        .dtype(DType::F32)
        .precision(Precision::Fp16);
    let plan = Plan::new(&prob).unwrap();
    let mut r = Rng(21);
    let mut u = r.vec(d);
    let norm = u.iter().map(|x| x * x).sum::<f32>().sqrt();
    let a = (12.0 * (d as f32).sqrt()).sqrt();
    u.iter_mut().for_each(|x| *x *= a / norm);
    let mut q = r.vec(hq * lq * d);
    let mut k = r.vec(hq * lkv * d);
    let v = r.vec(hq * lkv * d);
    for (i, x) in q.iter_mut().enumerate() {
        *x += u[i % d];
    }
    for h in 0..hq {
        for j in 0..64 {
            for c in 0..d {
                k[(h * lkv + j) * d + c] += u[c];
            }
        }
    }
    let ones = vec![1u8; plan.mask_shape().iter().product::<i64>() as usize];
    let mut first = ones.clone();
    first.iter_mut().enumerate().for_each(|(i, m)| *m = (i % (lkv / 64) == 0) as u8);
    let run = |mask: &[u8], pv: f32| {
        let params = PredictParams { pv_threshold: pv, ..Default::default() };
        let mut out = vec![0f32; q.len()];
        plan.attention(&q, &k, &v, Some(mask), Some(&params), &mut out, None).unwrap();
        out
    };
    let (base, skip, far, cut) = (run(&ones, 0.0), run(&ones, 1.0), run(&ones, 60.0), run(&first, 0.0));
    assert_eq!(skip, cut);
    assert_eq!(far, base);
    let changed = (0..hq * lq).filter(|&i| base[i * d..][..d] != skip[i * d..][..d]).count();
    assert!(changed > hq * lq * 9 / 10, "{changed} of {} rows changed", hq * lq);
}

#[test]
fn one_plan_many_threads() {
    let plan = std::sync::Arc::new(Plan::new(&exact_problem(1, 2, 2, 128, 128, 16, true)).unwrap());
    let mut r = Rng(1);
    let (q, k, v) = (r.vec(2 * 128 * 16), r.vec(2 * 128 * 16), r.vec(2 * 128 * 16));
    let ones = vec![1u8; plan.mask_shape().iter().product::<i64>() as usize];
    let (want, _) = reference(plan.problem(), &q, &k, &v, None);
    std::thread::scope(|s| {
        for _ in 0..4 {
            let (plan, q, k, v, ones, want) = (&plan, &q, &k, &v, &ones, &want);
            s.spawn(move || {
                let mut out = vec![0f32; q.len()];
                plan.attention(q, k, v, Some(ones), None, &mut out, None).unwrap();
                assert!(max_abs_diff(&out, want) < 1e-5);
            });
        }
    });
}

#[test]
fn merge_states_recovers_attention_over_all_keys_from_key_chunks() {
    let mut rng = Rng(0x5eed_0019 ^ std::process::id() as u64);
    let (b, hq, hkv, lq, d) = (1i64, 2i64, 1i64, 40i64, 16i64);
    let chunks = [64i64, 23, 41];
    let lkv: i64 = chunks.iter().sum();
    let q = rng.vec((b * hq * lq * d) as usize);
    let k = rng.vec((b * hkv * lkv * d) as usize);
    let v = rng.vec((b * hkv * lkv * d) as usize);
    let whole = exact_problem(b, hq, hkv, lq, lkv, d, false);
    let (ref_out, ref_lse) = reference(&whole, &q, &k, &v, None);
    // Each chunk's keys on their own (hkv == 1: the chunk is a contiguous run of k and v).
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    let mut start = 0usize;
    for &c in &chunks {
        let p = exact_problem(b, hq, hkv, lq, c, d, false);
        let plan = Plan::new(&p).unwrap();
        let kc = &k[start * d as usize..(start + c as usize) * d as usize];
        let vc = &v[start * d as usize..(start + c as usize) * d as usize];
        let mut o = vec![f32::NAN; (b * hq * lq * d) as usize];
        let mut l = vec![f32::NAN; (b * hq * lq) as usize];
        let mask = vec![1u8; plan.mask_shape().iter().product::<i64>() as usize];
        plan.attention(&q, kc, vc, Some(&mask), None, &mut o, Some(&mut l)).unwrap();
        outs.push(o);
        lses.push(l);
        start += c as usize;
    }
    let o_refs: Vec<&[f32]> = outs.iter().map(|x| x.as_slice()).collect();
    let l_refs: Vec<&[f32]> = lses.iter().map(|x| x.as_slice()).collect();
    let mut out = vec![f32::NAN; ref_out.len()];
    let mut lse = vec![f32::NAN; ref_lse.len()];
    sparge::merge_states(&o_refs, &l_refs, [b, hq, lq, d], &mut out, Some(&mut lse)).unwrap();
    for (g, r) in out.iter().zip(ref_out.iter()) {
        assert!((*g as f64 - r).abs() < 2e-6, "out {g} vs {r}");
    }
    for (g, r) in lse.iter().zip(ref_lse.iter()) {
        assert!((*g as f64 - r).abs() < 2e-6, "lse {g} vs {r}");
    }
    // An empty state (-inf everywhere, NaN outputs) changes nothing.
    let empty_o = vec![f32::NAN; out.len()];
    let empty_l = vec![f32::NEG_INFINITY; lse.len()];
    let mut out2 = vec![0f32; out.len()];
    sparge::merge_states(&[&out, &empty_o], &[&lse, &empty_l], [b, hq, lq, d], &mut out2, None).unwrap();
    assert_eq!(out, out2);
}

#[test]
fn merge_states_rejects_bad_arguments() {
    let o = vec![0.5f32; 2 * 3 * 4];
    let l = vec![0f32; 2 * 3];
    let mut out = vec![0f32; o.len()];
    let e = sparge::merge_states(&[], &[], [1, 2, 3, 4], &mut out, None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("count is 0"), "{}", e.message());
    let many_o: Vec<&[f32]> = vec![&o; sparge::MERGE_MAX_STATES + 1];
    let many_l: Vec<&[f32]> = vec![&l; sparge::MERGE_MAX_STATES + 1];
    let e = sparge::merge_states(&many_o, &many_l, [1, 2, 3, 4], &mut out, None).unwrap_err();
    assert!(e.message().contains("SPARGE_MERGE_MAX_STATES"), "{}", e.message());
    let e = sparge::merge_states(&[&o], &[&l[..5]], [1, 2, 3, 4], &mut out, None).unwrap_err();
    assert!(e.message().contains("lses[0]"), "{}", e.message());
}

#[test]
fn auto_precision_is_the_default_and_resolves_by_length() {
    assert_eq!(Problem::new(1, 2, 1, 64, 64, 64).precision, Precision::Auto);
    for (len, d, want) in [
        (1024, 128, Precision::Fp16),
        (16384, 128, Precision::Int8Fp8),
        (16384, 64, Precision::Fp16),
        (32768, 64, Precision::Fp16),
        (32768, 256, Precision::Fp16),
    ] {
        let plan = Plan::new(&Problem::new(1, 2, 1, len, len, d)).unwrap();
        assert_eq!(plan.problem().precision, want, "L {len} D {d}");
    }
}
