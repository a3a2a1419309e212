//! Safe Rust API for libsparge, training-free block-sparse attention behind a
//! stable C ABI.
//!
//! * [`Plan`] owns a plan handle (`NonNull`, destroyed in `Drop`, which never
//!   panics). A plan is immutable after creation: it is `Send + Sync` and may
//!   be used from several threads at once as long as each call has its own
//!   workspace (the host helpers allocate one per call).
//! * Every failure is an [`Error`]: the library's status plus its message.
//! * Host tensors: [`Plan::attention`] and [`Plan::predict_mask`] take `f32`
//!   slices in contiguous `[B, H, L, D]` order (CPU plans with `DType::F32`).
//! * Device memory or any other layout: [`TensorDesc`] with the `unsafe`
//!   [`Plan::attention_raw`] and [`Plan::predict_mask_raw`].
//!
//! ```no_run
//! use sparge::{DType, Device, Plan, PredictParams, Precision, Problem};
//! # fn main() -> sparge::Result<()> {
//! let problem = Problem::new(1, 4, 4, 1024, 1024, 64)
//!     .dtype(DType::F32)
//!     .device(Device::Cpu)
//!     .precision(Precision::Exact);
//! let plan = Plan::new(&problem)?;
//! let n = 4 * 1024 * 64;
//! let (q, k, v) = (vec![0.1f32; n], vec![0.2f32; n], vec![0.3f32; n]);
//! let mut out = vec![0f32; n];
//! let params = PredictParams { topk: 0.5, ..Default::default() };
//! plan.attention(&q, &k, &v, None, Some(&params), &mut out, None)?;
//! # Ok(()) }
//! ```

use std::ffi::{c_void, CStr};
use std::fmt;
use std::ptr::{self, NonNull};

pub use sparge_sys as sys;

pub mod tuned;

// ---------------------------------------------------------------- errors

/// Failure class, from `sparge_status_t` (or a check made on the Rust side).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    InvalidArgument,
    Unsupported,
    WorkspaceTooSmall,
    NoDevice,
    Cuda,
    OutOfMemory,
    Internal,
    /// A status value this crate does not know (a newer library).
    Unknown(i32),
}

impl Status {
    /// `None` for `SPARGE_OK`.
    pub fn from_raw(raw: sys::sparge_status_t) -> Option<Status> {
        Some(match raw {
            sys::SPARGE_OK => return None,
            sys::SPARGE_ERR_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::SPARGE_ERR_UNSUPPORTED => Status::Unsupported,
            sys::SPARGE_ERR_WORKSPACE_TOO_SMALL => Status::WorkspaceTooSmall,
            sys::SPARGE_ERR_NO_DEVICE => Status::NoDevice,
            sys::SPARGE_ERR_CUDA => Status::Cuda,
            sys::SPARGE_ERR_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::SPARGE_ERR_INTERNAL => Status::Internal,
            other => Status::Unknown(other),
        })
    }

    pub fn to_raw(self) -> sys::sparge_status_t {
        match self {
            Status::InvalidArgument => sys::SPARGE_ERR_INVALID_ARGUMENT,
            Status::Unsupported => sys::SPARGE_ERR_UNSUPPORTED,
            Status::WorkspaceTooSmall => sys::SPARGE_ERR_WORKSPACE_TOO_SMALL,
            Status::NoDevice => sys::SPARGE_ERR_NO_DEVICE,
            Status::Cuda => sys::SPARGE_ERR_CUDA,
            Status::OutOfMemory => sys::SPARGE_ERR_OUT_OF_MEMORY,
            Status::Internal => sys::SPARGE_ERR_INTERNAL,
            Status::Unknown(v) => v,
        }
    }

    /// The library's name for this status (`sparge_status_string`).
    pub fn name(self) -> String {
        cstr_to_string(unsafe { sys::sparge_status_string(self.to_raw()) })
    }
}

/// A failed call: its status and the message that names the argument at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    status: Status,
    message: String,
}

impl Error {
    pub fn status(&self) -> Status {
        self.status
    }
    pub fn message(&self) -> &str {
        &self.message
    }
    fn from_library(status: Status) -> Error {
        // The message is thread-local and read right after the failing call.
        Error { status, message: cstr_to_string(unsafe { sys::sparge_last_error() }) }
    }
    fn invalid(message: String) -> Error {
        Error { status: Status::InvalidArgument, message }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status.name(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

fn check(raw: sys::sparge_status_t) -> Result<()> {
    match Status::from_raw(raw) {
        None => Ok(()),
        Some(s) => Err(Error::from_library(s)),
    }
}

fn cstr_to_string(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Library version at run time (`sparge_version`).
pub fn version() -> (i32, i32, i32) {
    let (mut a, mut b, mut c) = (0, 0, 0);
    unsafe { sys::sparge_version(&mut a, &mut b, &mut c) };
    (a, b, c)
}

/// True when the loaded library has the CUDA backend.
pub fn has_cuda() -> bool {
    unsafe { sys::sparge_has_cuda() != 0 }
}

// ---------------------------------------------------------------- enums

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F16,
    BF16,
    F32,
    U8,
    I32,
}

impl DType {
    pub fn to_raw(self) -> sys::sparge_dtype_t {
        match self {
            DType::F16 => sys::SPARGE_DTYPE_FLOAT16,
            DType::BF16 => sys::SPARGE_DTYPE_BFLOAT16,
            DType::F32 => sys::SPARGE_DTYPE_FLOAT32,
            DType::U8 => sys::SPARGE_DTYPE_UINT8,
            DType::I32 => sys::SPARGE_DTYPE_INT32,
        }
    }
    pub fn from_raw(raw: sys::sparge_dtype_t) -> Option<DType> {
        Some(match raw {
            sys::SPARGE_DTYPE_FLOAT16 => DType::F16,
            sys::SPARGE_DTYPE_BFLOAT16 => DType::BF16,
            sys::SPARGE_DTYPE_FLOAT32 => DType::F32,
            sys::SPARGE_DTYPE_UINT8 => DType::U8,
            sys::SPARGE_DTYPE_INT32 => DType::I32,
            _ => return None,
        })
    }
}

/// Where a plan runs and its tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    /// A CUDA device ordinal.
    Cuda(i32),
}

impl Device {
    fn to_raw(self) -> (sys::sparge_device_type_t, i32) {
        match self {
            Device::Cpu => (sys::SPARGE_DEVICE_CPU, 0),
            Device::Cuda(id) => (sys::SPARGE_DEVICE_CUDA, id),
        }
    }
    fn from_raw(t: sys::sparge_device_type_t, id: i32) -> Option<Device> {
        match t {
            sys::SPARGE_DEVICE_CPU => Some(Device::Cpu),
            sys::SPARGE_DEVICE_CUDA => Some(Device::Cuda(id)),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    /// The plan picks `Int8Fp8` or `Fp16` (the default): `Int8Fp8` on compute capability 9.0 for
    /// 64 < head_dim <= 128 when the effective length 3 Lq Lkv / (Lq + 2 Lkv) reaches 16384, `Fp16`
    /// otherwise; CPU plans follow the compute capability 9.0 rule.
    /// `Plan::problem` reports the choice.
    Auto,
    /// Q, K int8; P, V fp8 e4m3; fp32 accumulation (the fastest at long sequences on sm_90).
    Int8Fp8,
    /// 16-bit inputs on tensor cores, fp32 accumulation.
    Fp16,
    /// float64 throughout (CPU only).
    Exact,
    /// `Int8Fp8` with V carried as two e4m3 terms (hi + lo on one per-channel scale): V's rounding
    /// error nearly vanishes (output relative L1 ~0.028 instead of ~0.038 on random normal inputs),
    /// for one more fp8 P.V product per key tile.
    Int8Fp8SplitV,
    /// Q, K int8 exactly as in `Int8Fp8`; P in the input's 16-bit type, V used as given; fp32
    /// accumulation. Only the int8 Q.K^T error remains (output relative L1 ~0.011 on random normal
    /// inputs), and there is no V preparation pass.
    Int8Fp16,
}

impl Precision {
    fn to_raw(self) -> sys::sparge_precision_t {
        match self {
            Precision::Int8Fp8 => sys::SPARGE_PRECISION_INT8_FP8,
            Precision::Fp16 => sys::SPARGE_PRECISION_FP16,
            Precision::Exact => sys::SPARGE_PRECISION_EXACT,
            Precision::Int8Fp8SplitV => sys::SPARGE_PRECISION_INT8_FP8_SPLIT_V,
            Precision::Int8Fp16 => sys::SPARGE_PRECISION_INT8_FP16,
            Precision::Auto => sys::SPARGE_PRECISION_AUTO,
        }
    }
    fn from_raw(raw: sys::sparge_precision_t) -> Option<Precision> {
        Some(match raw {
            sys::SPARGE_PRECISION_INT8_FP8 => Precision::Int8Fp8,
            sys::SPARGE_PRECISION_FP16 => Precision::Fp16,
            sys::SPARGE_PRECISION_EXACT => Precision::Exact,
            sys::SPARGE_PRECISION_INT8_FP8_SPLIT_V => Precision::Int8Fp8SplitV,
            sys::SPARGE_PRECISION_INT8_FP16 => Precision::Int8Fp16,
            sys::SPARGE_PRECISION_AUTO => Precision::Auto,
            _ => return None,
        })
    }
}

/// Block-importance estimator (`sparge_estimator_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Estimator {
    /// Mean-pooled Q and K (the original SpargeAttn rule).
    Mean,
    /// Mean-pooled Q against every key, log-sum-exp per key block (the default when causal).
    KeysLse,
    /// `KeysLse` for two groups of similar rows per query block, their block distributions averaged
    /// by group size (about twice the prediction cost of `KeysLse`).
    KeysLseSplit2,
    /// `KeysLseSplit2` on the query blocks whose mean row is short against their rows but not near
    /// zero (0.25 to 0.75 of the rows' mean length: rows that share a direction but spread), `KeysLse`
    /// on the others: the cost follows the share of split blocks (the default when not causal).
    KeysLseAdaptive,
    /// The default: the estimator of the mode, `KeysLseAdaptive` when not causal, `KeysLse` when causal
    /// (docs/ACCURACY.md, "Estimators").
    #[default]
    Auto,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SelectMode {
    /// Keep `max(1, floor(topk * visible + 1e-4))` blocks per row.
    TopK,
    /// Keep the smallest set of blocks whose probability reaches `cdf_threshold`.
    Cdf,
}

// ---------------------------------------------------------------- problem

/// One attention problem: q `[B, Hq, Lq, D]`, k and v `[B, Hkv, Lkv, D]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Problem {
    pub batch: i64,
    pub heads_q: i64,
    pub heads_kv: i64,
    pub len_q: i64,
    pub len_kv: i64,
    pub head_dim: i64,
    pub dtype: DType,
    pub device: Device,
    pub precision: Precision,
    /// Bottom-right aligned: query i sees key j iff j <= i + (Lkv - Lq).
    pub causal: bool,
    /// Softmax scale; 0 means 1/sqrt(D).
    pub scale: f32,
    /// Mask block rows; 0 means 128.
    pub block_q: i32,
    /// Mask block columns; 0 means 64.
    pub block_k: i32,
}

impl Problem {
    /// A problem with the header's defaults for everything but the shape
    /// (bf16, CPU, precision auto, non-causal, default scale and blocks).
    pub fn new(batch: i64, heads_q: i64, heads_kv: i64, len_q: i64, len_kv: i64, head_dim: i64) -> Problem {
        Problem {
            batch,
            heads_q,
            heads_kv,
            len_q,
            len_kv,
            head_dim,
            dtype: DType::BF16,
            device: Device::Cpu,
            precision: Precision::Auto,
            causal: false,
            scale: 0.0,
            block_q: 0,
            block_k: 0,
        }
    }
    pub fn dtype(mut self, d: DType) -> Self {
        self.dtype = d;
        self
    }
    pub fn device(mut self, d: Device) -> Self {
        self.device = d;
        self
    }
    pub fn precision(mut self, p: Precision) -> Self {
        self.precision = p;
        self
    }
    pub fn causal(mut self, c: bool) -> Self {
        self.causal = c;
        self
    }
    pub fn scale(mut self, s: f32) -> Self {
        self.scale = s;
        self
    }
    pub fn blocks(mut self, block_q: i32, block_k: i32) -> Self {
        self.block_q = block_q;
        self.block_k = block_k;
        self
    }

    pub fn to_raw(&self) -> sys::sparge_problem_t {
        let (device_type, device_id) = self.device.to_raw();
        sys::sparge_problem_t {
            struct_size: std::mem::size_of::<sys::sparge_problem_t>(),
            batch: self.batch,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            len_q: self.len_q,
            len_kv: self.len_kv,
            head_dim: self.head_dim,
            dtype: self.dtype.to_raw(),
            device_type,
            device_id,
            precision: self.precision.to_raw(),
            causal: self.causal as i32,
            scale: self.scale,
            block_q: self.block_q,
            block_k: self.block_k,
        }
    }

    fn from_raw(r: &sys::sparge_problem_t) -> Result<Problem> {
        let bad = |what: &str| Error { status: Status::Internal, message: format!("resolved problem: unknown {what}") };
        Ok(Problem {
            batch: r.batch,
            heads_q: r.heads_q,
            heads_kv: r.heads_kv,
            len_q: r.len_q,
            len_kv: r.len_kv,
            head_dim: r.head_dim,
            dtype: DType::from_raw(r.dtype).ok_or_else(|| bad("dtype"))?,
            device: Device::from_raw(r.device_type, r.device_id).ok_or_else(|| bad("device_type"))?,
            precision: Precision::from_raw(r.precision).ok_or_else(|| bad("precision"))?,
            causal: r.causal != 0,
            scale: r.scale,
            block_q: r.block_q,
            block_k: r.block_k,
        })
    }

    /// Number of mask block rows and columns, `[ceil(Lq/BQ), ceil(Lkv/BK)]`
    /// (after defaults: use it on `Plan::problem()`).
    pub fn mask_blocks(&self) -> (i64, i64) {
        let bq = if self.block_q > 0 { self.block_q as i64 } else { 128 };
        let bk = if self.block_k > 0 { self.block_k as i64 } else { 64 };
        ((self.len_q + bq - 1) / bq, (self.len_kv + bk - 1) / bk)
    }
}

// ---------------------------------------------------------------- prediction parameters

/// Mask prediction hyper-parameters (`sparge_predict_params_t`).
#[derive(Debug, Clone, PartialEq)]
pub struct PredictParams {
    pub mode: SelectMode,
    /// (0, 1], top-k mode.
    pub topk: f32,
    /// (0, 1], CDF mode.
    pub cdf_threshold: f32,
    /// Blocks whose self-similarity is below this are kept whole; <= 0 disables.
    pub sim_threshold: f32,
    /// Subtract the per-head mean of K before predicting.
    pub smooth_k: bool,
    /// Keep key block 0 in every row, counted in the budget; None = the default (on).
    pub attention_sink: Option<bool>,
    /// Keep the diagonal key blocks and `w - 1` more on each side, counted in the budget;
    /// Some(0) = off; None = the default of the mode (2 when causal, 1 otherwise).
    pub local_window: Option<i32>,
    /// Block-importance estimator; the default is `Auto` (`KeysLseAdaptive` when not causal, `KeysLse`
    /// when causal).
    pub estimator: Estimator,
    /// Per-query-head overrides (length Hq). Host memory: CPU plans only here;
    /// for device arrays build a raw struct and use the `_raw` calls.
    pub topk_per_head: Option<Vec<f32>>,
    pub cdf_threshold_per_head: Option<Vec<f32>>,
    pub sim_threshold_per_head: Option<Vec<f32>>,
    /// PV skip threshold in nats; 0 = off. With `t > 0` a query row skips an online-softmax step
    /// (its keys get weight 0, no P·V for them) when the step's largest score is below the row's
    /// running maximum minus `t`. Every precision but `Exact` (there a positive value is
    /// `Unsupported`); NaN, negative or infinite values are `InvalidArgument`.
    pub pv_threshold: f32,
}

impl Default for PredictParams {
    fn default() -> Self {
        let d = sys::sparge_predict_params_t::default();
        PredictParams {
            mode: SelectMode::TopK,
            topk: d.topk,
            cdf_threshold: d.cdf_threshold,
            sim_threshold: d.sim_threshold,
            smooth_k: d.smooth_k != 0,
            attention_sink: None,
            local_window: None,
            estimator: Estimator::Auto,
            topk_per_head: None,
            cdf_threshold_per_head: None,
            sim_threshold_per_head: None,
            pv_threshold: d.pv_threshold,
        }
    }
}

impl PredictParams {
    /// The raw struct; its per-head pointers borrow from `self`.
    pub fn to_raw(&self) -> sys::sparge_predict_params_t {
        let p = |v: &Option<Vec<f32>>| v.as_ref().map_or(ptr::null(), |v| v.as_ptr());
        sys::sparge_predict_params_t {
            struct_size: std::mem::size_of::<sys::sparge_predict_params_t>(),
            mode: match self.mode {
                SelectMode::TopK => sys::SPARGE_SELECT_TOPK,
                SelectMode::Cdf => sys::SPARGE_SELECT_CDF,
            },
            topk: self.topk,
            cdf_threshold: self.cdf_threshold,
            sim_threshold: self.sim_threshold,
            smooth_k: self.smooth_k as i32,
            attention_sink: self.attention_sink.map_or(-1, |b| b as i32),
            topk_per_head: p(&self.topk_per_head),
            cdf_threshold_per_head: p(&self.cdf_threshold_per_head),
            sim_threshold_per_head: p(&self.sim_threshold_per_head),
            pv_threshold: self.pv_threshold,
            local_window: self.local_window.unwrap_or(-1),
            estimator: match self.estimator {
                Estimator::Mean => sys::SPARGE_ESTIMATOR_MEAN,
                Estimator::KeysLse => sys::SPARGE_ESTIMATOR_KEYS_LSE,
                Estimator::KeysLseSplit2 => sys::SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2,
                Estimator::KeysLseAdaptive => sys::SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE,
                Estimator::Auto => sys::SPARGE_ESTIMATOR_AUTO,
            },
        }
    }

    fn has_per_head(&self) -> bool {
        self.topk_per_head.is_some() || self.cdf_threshold_per_head.is_some() || self.sim_threshold_per_head.is_some()
    }
}

// ---------------------------------------------------------------- tensors

/// A borrowed, strided tensor description (`sparge_tensor_t`): pointer,
/// device, dtype, shape and strides in elements. Describing memory is safe;
/// handing a description to the library is `unsafe` (the pointer must be valid
/// for the shape and strides, in the plan's memory space).
#[derive(Debug, Clone, Copy)]
#[repr(transparent)]
pub struct TensorDesc(sys::sparge_tensor_t);

impl TensorDesc {
    /// `shape` and `strides` of equal length, 1 to 4 dimensions.
    pub fn new(data: *mut c_void, device: Device, dtype: DType, shape: &[i64], strides: &[i64]) -> Result<TensorDesc> {
        if shape.is_empty() || shape.len() > sys::SPARGE_MAX_DIMS || shape.len() != strides.len() {
            return Err(Error::invalid(format!(
                "TensorDesc: expected 1..=4 dimensions with as many strides, got shape {shape:?} strides {strides:?}"
            )));
        }
        let (device_type, device_id) = device.to_raw();
        let mut t = sys::sparge_tensor_t {
            data,
            device_type,
            device_id,
            dtype: dtype.to_raw(),
            ndim: shape.len() as i32,
            shape: [0; 4],
            strides: [0; 4],
        };
        t.shape[..shape.len()].copy_from_slice(shape);
        t.strides[..strides.len()].copy_from_slice(strides);
        Ok(TensorDesc(t))
    }

    /// Row-major (contiguous) strides for `shape`.
    pub fn contiguous(data: *mut c_void, device: Device, dtype: DType, shape: &[i64]) -> Result<TensorDesc> {
        let mut strides = vec![1i64; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        TensorDesc::new(data, device, dtype, shape, &strides)
    }

    pub fn as_raw(&self) -> &sys::sparge_tensor_t {
        &self.0
    }
    pub fn data(&self) -> *mut c_void {
        self.0.data
    }
    pub fn shape(&self) -> &[i64] {
        &self.0.shape[..self.0.ndim as usize]
    }
    pub fn strides(&self) -> &[i64] {
        &self.0.strides[..self.0.ndim as usize]
    }
}

fn opt_raw(t: Option<&TensorDesc>) -> *const sys::sparge_tensor_t {
    t.map_or(ptr::null(), |t| t.as_raw() as *const _)
}

// ---------------------------------------------------------------- merging partial states

/// Most partial states one [`merge_states`] call combines.
pub const MERGE_MAX_STATES: usize = sys::SPARGE_MERGE_MAX_STATES;

/// Combines partial attention states exactly by their LSE (`sparge_merge_states`):
/// `outs[i]` `[B, H, L, D]` (F16, BF16 or F32, any strides), `lses[i]` F32
/// `[B, H, L]`; `out` may be one of `outs` and `lse_out` one of `lses`.
///
/// # Safety
/// Every descriptor must describe valid memory of its shape, strides and dtype
/// on its device, and `stream` must be NULL or a valid CUDA stream of that
/// device. Nothing may be freed before the work on `stream` completes.
pub unsafe fn merge_states_raw(
    outs: &[TensorDesc],
    lses: &[TensorDesc],
    out: &TensorDesc,
    lse_out: Option<&TensorDesc>,
    stream: *mut c_void,
) -> Result<()> {
    if outs.len() != lses.len() {
        return Err(Error::invalid(format!(
            "merge_states: {} outputs but {} LSEs",
            outs.len(),
            lses.len()
        )));
    }
    let count = i32::try_from(outs.len()).unwrap_or(i32::MAX);
    // TensorDesc is repr(transparent) over sparge_tensor_t.
    check(sys::sparge_merge_states(
        count,
        outs.as_ptr() as *const sys::sparge_tensor_t,
        lses.as_ptr() as *const sys::sparge_tensor_t,
        out.as_raw(),
        opt_raw(lse_out),
        stream,
    ))
}

/// [`merge_states_raw`] on contiguous host `f32` slices: `outs[i]` and `out`
/// hold `shape` = `[B, H, L, D]` elements, `lses[i]` and `lse_out` `[B, H, L]`.
pub fn merge_states(
    outs: &[&[f32]],
    lses: &[&[f32]],
    shape: [i64; 4],
    out: &mut [f32],
    lse_out: Option<&mut [f32]>,
) -> Result<()> {
    if outs.len() != lses.len() {
        return Err(Error::invalid(format!(
            "merge_states: {} outputs but {} LSEs",
            outs.len(),
            lses.len()
        )));
    }
    let ls = [shape[0], shape[1], shape[2]];
    let cpu = Device::Cpu;
    let mut od = Vec::with_capacity(outs.len());
    let mut ld = Vec::with_capacity(lses.len());
    for (i, (o, l)) in outs.iter().zip(lses.iter()).enumerate() {
        Plan::check_len(&format!("outs[{i}]"), o.len(), &shape)?;
        Plan::check_len(&format!("lses[{i}]"), l.len(), &ls)?;
        od.push(TensorDesc::contiguous(o.as_ptr() as *mut c_void, cpu, DType::F32, &shape)?);
        ld.push(TensorDesc::contiguous(l.as_ptr() as *mut c_void, cpu, DType::F32, &ls)?);
    }
    Plan::check_len("out", out.len(), &shape)?;
    let o = TensorDesc::contiguous(out.as_mut_ptr() as *mut c_void, cpu, DType::F32, &shape)?;
    let l = match lse_out {
        Some(l) => {
            Plan::check_len("lse_out", l.len(), &ls)?;
            Some(TensorDesc::contiguous(l.as_mut_ptr() as *mut c_void, cpu, DType::F32, &ls)?)
        }
        None => None,
    };
    // Safety: every descriptor covers a live slice of exactly its shape (checked above); the
    // CPU backend runs synchronously and only reads outs and lses.
    unsafe { merge_states_raw(&od, &ld, &o, l.as_ref(), ptr::null_mut()) }
}

// ---------------------------------------------------------------- workspace

/// Host scratch memory, 256-byte aligned, for CPU plans.
pub struct Workspace {
    buf: Vec<u8>,
    offset: usize,
    len: usize,
}

impl Workspace {
    pub fn new(bytes: usize) -> Workspace {
        let buf = vec![0u8; if bytes == 0 { 0 } else { bytes + 256 }];
        let offset = if bytes == 0 { 0 } else { buf.as_ptr().align_offset(256) };
        Workspace { buf, offset, len: bytes }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// NULL for an empty workspace.
    pub fn as_mut_ptr(&mut self) -> *mut c_void {
        if self.len == 0 {
            ptr::null_mut()
        } else {
            unsafe { self.buf.as_mut_ptr().add(self.offset) as *mut c_void }
        }
    }
}

// ---------------------------------------------------------------- plan

/// A validated problem with its workspace layout. Immutable; `Send + Sync`.
pub struct Plan {
    raw: NonNull<sys::sparge_plan>,
    problem: Problem,
}

// The library documents a plan as immutable after creation and safe to use
// from several threads at once, each call with its own workspace.
unsafe impl Send for Plan {}
unsafe impl Sync for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // sparge_destroy_plan cannot fail and never unwinds.
        unsafe { sys::sparge_destroy_plan(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plan").field("problem", &self.problem).finish()
    }
}

/// What a plan runs (`sparge_kernel_info_t`): family ("sm90", "portable", "cpu"),
/// instance name and tile facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelInfo {
    pub family: String,
    pub name: String,
    pub sm_version: i32,
    pub head_dim: i32,
    pub block_q: i32,
    pub keys_per_step: i32,
    pub stages: i32,
    pub threads: i32,
    pub smem_bytes: i32,
}

impl Plan {
    /// Validates `problem` and computes the workspace layout (CUDA plans also
    /// check the device here).
    pub fn new(problem: &Problem) -> Result<Plan> {
        let raw_problem = problem.to_raw();
        let mut out: sys::sparge_plan_t = ptr::null_mut();
        check(unsafe { sys::sparge_create_plan(&raw_problem, &mut out) })?;
        let raw = NonNull::new(out).ok_or_else(|| Error {
            status: Status::Internal,
            message: "sparge_create_plan returned OK and a NULL plan".into(),
        })?;
        // From here on `plan` owns the handle, so an error below still frees it.
        let mut plan = Plan { raw, problem: *problem };
        let mut resolved = sys::sparge_problem_t::default();
        check(unsafe { sys::sparge_plan_get_problem(plan.raw.as_ptr(), &mut resolved) })?;
        plan.problem = Problem::from_raw(&resolved)?;
        Ok(plan)
    }

    /// The problem with defaults resolved (scale, block sizes, the choice of `Precision::Auto`).
    pub fn problem(&self) -> &Problem {
        &self.problem
    }

    pub fn as_raw(&self) -> sys::sparge_plan_t {
        self.raw.as_ptr()
    }

    /// Bytes of scratch memory each call needs (in the plan's memory space).
    pub fn workspace_size(&self) -> Result<usize> {
        let mut bytes = 0usize;
        check(unsafe { sys::sparge_plan_workspace_size(self.raw.as_ptr(), &mut bytes) })?;
        Ok(bytes)
    }

    /// Causally visible (query-block, key-block) pairs per (batch, head).
    pub fn visible_blocks(&self) -> Result<i64> {
        let mut n = 0i64;
        check(unsafe { sys::sparge_plan_visible_blocks(self.raw.as_ptr(), &mut n) })?;
        Ok(n)
    }

    /// The attention kernel the plan chose. See `sparge_plan_kernel_info`.
    pub fn kernel_info(&self) -> Result<KernelInfo> {
        let mut raw = sys::sparge_kernel_info_t::default();
        check(unsafe { sys::sparge_plan_kernel_info(self.raw.as_ptr(), &mut raw) })?;
        let text = |b: &[core::ffi::c_char]| -> String {
            let bytes: Vec<u8> = b.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        };
        Ok(KernelInfo {
            family: text(&raw.family),
            name: text(&raw.name),
            sm_version: raw.sm_version,
            head_dim: raw.head_dim,
            block_q: raw.block_q,
            keys_per_step: raw.keys_per_step,
            stages: raw.stages,
            threads: raw.threads,
            smem_bytes: raw.smem_bytes,
        })
    }

    /// Mask shape `[B, Hq, nQB, nKB]`.
    pub fn mask_shape(&self) -> [i64; 4] {
        let (nq, nk) = self.problem.mask_blocks();
        [self.problem.batch, self.problem.heads_q, nq, nk]
    }

    /// Predicts the block mask. See `sparge_predict_mask`.
    ///
    /// # Safety
    /// Every descriptor must describe valid memory of its shape, strides and
    /// dtype in the plan's memory space, `workspace` must hold
    /// `workspace_bytes` bytes there (or be NULL when the size is 0), any
    /// per-head pointers in `params` must hold Hq floats, and `stream` must be
    /// NULL or a valid CUDA stream of the plan's device. Nothing may be freed
    /// before the work on `stream` completes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn predict_mask_raw(
        &self,
        q: &TensorDesc,
        k: &TensorDesc,
        params: Option<&sys::sparge_predict_params_t>,
        mask_out: &TensorDesc,
        kept_out: Option<&TensorDesc>,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: *mut c_void,
    ) -> Result<()> {
        check(sys::sparge_predict_mask(
            self.raw.as_ptr(),
            q.as_raw(),
            k.as_raw(),
            params.map_or(ptr::null(), |p| p as *const _),
            mask_out.as_raw(),
            opt_raw(kept_out),
            workspace,
            workspace_bytes,
            stream,
        ))
    }

    /// Block-sparse attention; `mask` None predicts it inside. See
    /// `sparge_attention_run`.
    ///
    /// # Safety
    /// As for [`Plan::predict_mask_raw`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attention_raw(
        &self,
        q: &TensorDesc,
        k: &TensorDesc,
        v: &TensorDesc,
        mask: Option<&TensorDesc>,
        params: Option<&sys::sparge_predict_params_t>,
        out: &TensorDesc,
        lse: Option<&TensorDesc>,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: *mut c_void,
    ) -> Result<()> {
        check(sys::sparge_attention_run(
            self.raw.as_ptr(),
            q.as_raw(),
            k.as_raw(),
            v.as_raw(),
            opt_raw(mask),
            params.map_or(ptr::null(), |p| p as *const _),
            out.as_raw(),
            opt_raw(lse),
            workspace,
            workspace_bytes,
            stream,
        ))
    }

    // ------------------------------------------------------------ host helpers

    fn host_f32_check(&self) -> Result<()> {
        if self.problem.device != Device::Cpu || self.problem.dtype != DType::F32 {
            return Err(Error::invalid(format!(
                "host slice helpers need a CPU plan with dtype F32 (this plan: {:?}, {:?}); use the _raw calls",
                self.problem.device, self.problem.dtype
            )));
        }
        Ok(())
    }

    fn check_len(name: &str, got: usize, shape: &[i64]) -> Result<()> {
        let want: i64 = shape.iter().product();
        if got as i64 != want {
            return Err(Error::invalid(format!(
                "{name}: expected {want} elements (shape {shape:?}, contiguous), got {got}"
            )));
        }
        Ok(())
    }

    fn check_params(&self, params: Option<&PredictParams>) -> Result<()> {
        if let Some(p) = params {
            if p.has_per_head() && self.problem.device != Device::Cpu {
                return Err(Error::invalid(
                    "per-head parameter vectors are host memory: CPU plans only here".into(),
                ));
            }
            for (name, v) in [
                ("topk_per_head", &p.topk_per_head),
                ("cdf_threshold_per_head", &p.cdf_threshold_per_head),
                ("sim_threshold_per_head", &p.sim_threshold_per_head),
            ] {
                if let Some(v) = v {
                    if v.len() as i64 != self.problem.heads_q {
                        return Err(Error::invalid(format!(
                            "params.{name}: expected {} values (Hq), got {}",
                            self.problem.heads_q,
                            v.len()
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    fn qkv_shapes(&self) -> ([i64; 4], [i64; 4]) {
        let p = &self.problem;
        ([p.batch, p.heads_q, p.len_q, p.head_dim], [p.batch, p.heads_kv, p.len_kv, p.head_dim])
    }

    /// Predicts the block mask from host `f32` q `[B, Hq, Lq, D]` and k
    /// `[B, Hkv, Lkv, D]` (contiguous). `mask_out`: `[B, Hq, nQB, nKB]`;
    /// `kept_out` (optional): `[B, Hq]` kept-block counts.
    pub fn predict_mask(
        &self,
        q: &[f32],
        k: &[f32],
        params: Option<&PredictParams>,
        mask_out: &mut [u8],
        kept_out: Option<&mut [i32]>,
    ) -> Result<()> {
        self.host_f32_check()?;
        self.check_params(params)?;
        let (qs, ks) = self.qkv_shapes();
        let ms = self.mask_shape();
        Self::check_len("q", q.len(), &qs)?;
        Self::check_len("k", k.len(), &ks)?;
        Self::check_len("mask_out", mask_out.len(), &ms)?;
        let kept_shape = [self.problem.batch, self.problem.heads_q];
        let cpu = Device::Cpu;
        let qd = TensorDesc::contiguous(q.as_ptr() as *mut c_void, cpu, DType::F32, &qs)?;
        let kd = TensorDesc::contiguous(k.as_ptr() as *mut c_void, cpu, DType::F32, &ks)?;
        let md = TensorDesc::contiguous(mask_out.as_mut_ptr() as *mut c_void, cpu, DType::U8, &ms)?;
        let kept = match kept_out {
            Some(kept) => {
                Self::check_len("kept_out", kept.len(), &kept_shape)?;
                Some(TensorDesc::contiguous(kept.as_mut_ptr() as *mut c_void, cpu, DType::I32, &kept_shape)?)
            }
            None => None,
        };
        let raw_params = params.map(|p| p.to_raw());
        let mut ws = Workspace::new(self.workspace_size()?);
        // Safety: every descriptor covers a live slice of exactly its shape
        // (checked above); per-head vectors have Hq entries; CPU plan, no stream.
        unsafe {
            self.predict_mask_raw(
                &qd,
                &kd,
                raw_params.as_ref(),
                &md,
                kept.as_ref(),
                ws.as_mut_ptr(),
                ws.len(),
                ptr::null_mut(),
            )
        }
    }

    /// Block-sparse attention on host `f32` tensors (contiguous `[B, H, L, D]`).
    /// `mask`: `[B, Hq, nQB, nKB]` (1 = compute), or None to predict it with
    /// `params` (None = defaults). `out`: q's shape. `lse` (optional): `[B, Hq, Lq]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        mask: Option<&[u8]>,
        params: Option<&PredictParams>,
        out: &mut [f32],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        self.host_f32_check()?;
        self.check_params(params)?;
        let (qs, ks) = self.qkv_shapes();
        let ms = self.mask_shape();
        let ls = [self.problem.batch, self.problem.heads_q, self.problem.len_q];
        Self::check_len("q", q.len(), &qs)?;
        Self::check_len("k", k.len(), &ks)?;
        Self::check_len("v", v.len(), &ks)?;
        Self::check_len("out", out.len(), &qs)?;
        let cpu = Device::Cpu;
        let qd = TensorDesc::contiguous(q.as_ptr() as *mut c_void, cpu, DType::F32, &qs)?;
        let kd = TensorDesc::contiguous(k.as_ptr() as *mut c_void, cpu, DType::F32, &ks)?;
        let vd = TensorDesc::contiguous(v.as_ptr() as *mut c_void, cpu, DType::F32, &ks)?;
        let od = TensorDesc::contiguous(out.as_mut_ptr() as *mut c_void, cpu, DType::F32, &qs)?;
        let md = match mask {
            Some(m) => {
                Self::check_len("mask", m.len(), &ms)?;
                Some(TensorDesc::contiguous(m.as_ptr() as *mut c_void, cpu, DType::U8, &ms)?)
            }
            None => None,
        };
        let ld = match lse {
            Some(l) => {
                Self::check_len("lse", l.len(), &ls)?;
                Some(TensorDesc::contiguous(l.as_mut_ptr() as *mut c_void, cpu, DType::F32, &ls)?)
            }
            None => None,
        };
        let raw_params = params.map(|p| p.to_raw());
        let mut ws = Workspace::new(self.workspace_size()?);
        // Safety: as in predict_mask; the library only reads q, k, v and mask.
        unsafe {
            self.attention_raw(
                &qd,
                &kd,
                &vd,
                md.as_ref(),
                raw_params.as_ref(),
                &od,
                ld.as_ref(),
                ws.as_mut_ptr(),
                ws.len(),
                ptr::null_mut(),
            )
        }
    }
}
