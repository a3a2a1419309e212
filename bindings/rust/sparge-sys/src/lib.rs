//! Raw declarations of the libsparge C ABI (`include/sparge/sparge.h`).
//!
//! Everything here mirrors the header one to one: `#[repr(C)]` structs, C enums
//! as integer type aliases with their constants (a Rust `enum` must never hold
//! a value the library did not define), and the `extern "C"` entry points.
//! The safe wrapper is the `sparge` crate.
#![allow(non_camel_case_types)]
#![cfg_attr(not(test), no_std)]

use core::ffi::{c_char, c_int, c_void};

pub const SPARGE_VERSION_MAJOR: c_int = 0;
pub const SPARGE_VERSION_MINOR: c_int = 1;
pub const SPARGE_VERSION_PATCH: c_int = 0;
pub const SPARGE_VERSION_NUMBER: c_int =
    SPARGE_VERSION_MAJOR * 10000 + SPARGE_VERSION_MINOR * 100 + SPARGE_VERSION_PATCH;
pub const SPARGE_MAX_DIMS: usize = 4;

// ---------------------------------------------------------------- enums
pub type sparge_status_t = c_int;
pub const SPARGE_OK: sparge_status_t = 0;
pub const SPARGE_ERR_INVALID_ARGUMENT: sparge_status_t = 1;
pub const SPARGE_ERR_UNSUPPORTED: sparge_status_t = 2;
pub const SPARGE_ERR_WORKSPACE_TOO_SMALL: sparge_status_t = 3;
pub const SPARGE_ERR_NO_DEVICE: sparge_status_t = 4;
pub const SPARGE_ERR_CUDA: sparge_status_t = 5;
pub const SPARGE_ERR_OUT_OF_MEMORY: sparge_status_t = 6;
pub const SPARGE_ERR_INTERNAL: sparge_status_t = 7;

pub type sparge_dtype_t = c_int;
pub const SPARGE_DTYPE_FLOAT16: sparge_dtype_t = 0;
pub const SPARGE_DTYPE_BFLOAT16: sparge_dtype_t = 1;
pub const SPARGE_DTYPE_FLOAT32: sparge_dtype_t = 2;
pub const SPARGE_DTYPE_UINT8: sparge_dtype_t = 3;
pub const SPARGE_DTYPE_INT32: sparge_dtype_t = 4;

pub type sparge_device_type_t = c_int;
pub const SPARGE_DEVICE_CPU: sparge_device_type_t = 0;
pub const SPARGE_DEVICE_CUDA: sparge_device_type_t = 1;

pub type sparge_precision_t = c_int;
pub const SPARGE_PRECISION_INT8_FP8: sparge_precision_t = 0;
pub const SPARGE_PRECISION_FP16: sparge_precision_t = 1;
pub const SPARGE_PRECISION_EXACT: sparge_precision_t = 2;
pub const SPARGE_PRECISION_INT8_FP8_SPLIT_V: sparge_precision_t = 3;
pub const SPARGE_PRECISION_INT8_FP16: sparge_precision_t = 4;
pub const SPARGE_PRECISION_AUTO: sparge_precision_t = 5;

pub type sparge_select_mode_t = c_int;
pub const SPARGE_SELECT_TOPK: sparge_select_mode_t = 0;
pub const SPARGE_SELECT_CDF: sparge_select_mode_t = 1;

pub type sparge_estimator_t = c_int;
pub const SPARGE_ESTIMATOR_MEAN: sparge_estimator_t = 0;
pub const SPARGE_ESTIMATOR_KEYS_LSE: sparge_estimator_t = 1;
pub const SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2: sparge_estimator_t = 2;
pub const SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE: sparge_estimator_t = 3;
/// The default of the mode: `KEYS_LSE_ADAPTIVE` when not causal, `KEYS_LSE` when causal.
pub const SPARGE_ESTIMATOR_AUTO: sparge_estimator_t = 4;

// ---------------------------------------------------------------- structs
/// A borrowed, strided tensor view (strides in elements).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct sparge_tensor_t {
    pub data: *mut c_void,
    pub device_type: sparge_device_type_t,
    pub device_id: i32,
    pub dtype: sparge_dtype_t,
    pub ndim: i32,
    pub shape: [i64; SPARGE_MAX_DIMS],
    pub strides: [i64; SPARGE_MAX_DIMS],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct sparge_problem_t {
    pub struct_size: usize,
    pub batch: i64,
    pub heads_q: i64,
    pub heads_kv: i64,
    pub len_q: i64,
    pub len_kv: i64,
    pub head_dim: i64,
    pub dtype: sparge_dtype_t,
    pub device_type: sparge_device_type_t,
    pub device_id: i32,
    pub precision: sparge_precision_t,
    pub causal: i32,
    pub scale: f32,
    pub block_q: i32,
    pub block_k: i32,
}

/// `sparge_kernel_info_t`: the attention kernel a plan chose.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct sparge_kernel_info_t {
    pub struct_size: usize,
    pub family: [core::ffi::c_char; 16],
    pub name: [core::ffi::c_char; 64],
    pub sm_version: i32,
    pub head_dim: i32,
    pub block_q: i32,
    pub keys_per_step: i32,
    pub stages: i32,
    pub threads: i32,
    pub smem_bytes: i32,
}

impl Default for sparge_kernel_info_t {
    fn default() -> Self {
        sparge_kernel_info_t {
            struct_size: core::mem::size_of::<sparge_kernel_info_t>(),
            family: [0; 16],
            name: [0; 64],
            sm_version: 0,
            head_dim: 0,
            block_q: 0,
            keys_per_step: 0,
            stages: 0,
            threads: 0,
            smem_bytes: 0,
        }
    }
}

impl Default for sparge_problem_t {
    /// The same values as `SPARGE_PROBLEM_INIT`.
    fn default() -> Self {
        sparge_problem_t {
            struct_size: core::mem::size_of::<sparge_problem_t>(),
            batch: 1,
            heads_q: 1,
            heads_kv: 1,
            len_q: 0,
            len_kv: 0,
            head_dim: 128,
            dtype: SPARGE_DTYPE_BFLOAT16,
            device_type: SPARGE_DEVICE_CPU,
            device_id: 0,
            precision: SPARGE_PRECISION_AUTO,
            causal: 0,
            scale: 0.0,
            block_q: 0,
            block_k: 0,
        }
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct sparge_predict_params_t {
    pub struct_size: usize,
    pub mode: sparge_select_mode_t,
    pub topk: f32,
    pub cdf_threshold: f32,
    pub sim_threshold: f32,
    pub smooth_k: i32,
    pub attention_sink: i32,
    pub topk_per_head: *const f32,
    pub cdf_threshold_per_head: *const f32,
    pub sim_threshold_per_head: *const f32,
    /// PV skip threshold in nats: 0 = off; finite > 0 on (not with `SPARGE_PRECISION_EXACT`).
    pub pv_threshold: f32,
    /// Since 0.2: -1 = the default of the mode (causal 2, else 1), 0 = off, w >= 1 = diagonal blocks and
    /// w - 1 more per side.
    pub local_window: i32,
    /// Since 0.2: `SPARGE_ESTIMATOR_*`; `SPARGE_ESTIMATOR_AUTO` (the default) = the default of the mode.
    pub estimator: sparge_estimator_t,
}

impl Default for sparge_predict_params_t {
    /// The same values as `SPARGE_PREDICT_PARAMS_INIT`.
    fn default() -> Self {
        sparge_predict_params_t {
            struct_size: core::mem::size_of::<sparge_predict_params_t>(),
            mode: SPARGE_SELECT_TOPK,
            topk: 0.5,
            cdf_threshold: 0.9,
            sim_threshold: -0.1,
            smooth_k: 1,
            attention_sink: -1,
            topk_per_head: core::ptr::null(),
            cdf_threshold_per_head: core::ptr::null(),
            sim_threshold_per_head: core::ptr::null(),
            pv_threshold: 0.0,
            local_window: -1,
            estimator: SPARGE_ESTIMATOR_AUTO,
        }
    }
}

/// Opaque plan object.
#[repr(C)]
pub struct sparge_plan {
    _private: [u8; 0],
    _not_send_sync: core::marker::PhantomData<(*mut u8, core::marker::PhantomPinned)>,
}
pub type sparge_plan_t = *mut sparge_plan;

// ---------------------------------------------------------------- functions
extern "C" {
    pub fn sparge_create_plan(problem: *const sparge_problem_t, out: *mut sparge_plan_t) -> sparge_status_t;
    pub fn sparge_plan_workspace_size(plan: sparge_plan_t, bytes: *mut usize) -> sparge_status_t;
    pub fn sparge_plan_get_problem(plan: sparge_plan_t, problem: *mut sparge_problem_t) -> sparge_status_t;
    pub fn sparge_plan_visible_blocks(plan: sparge_plan_t, visible_per_head: *mut i64) -> sparge_status_t;
    pub fn sparge_plan_kernel_info(plan: sparge_plan_t, info: *mut sparge_kernel_info_t) -> sparge_status_t;
    pub fn sparge_predict_mask(
        plan: sparge_plan_t,
        q: *const sparge_tensor_t,
        k: *const sparge_tensor_t,
        params: *const sparge_predict_params_t,
        mask_out: *const sparge_tensor_t,
        kept_out: *const sparge_tensor_t,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: *mut c_void,
    ) -> sparge_status_t;
    pub fn sparge_attention_run(
        plan: sparge_plan_t,
        q: *const sparge_tensor_t,
        k: *const sparge_tensor_t,
        v: *const sparge_tensor_t,
        mask: *const sparge_tensor_t,
        params: *const sparge_predict_params_t,
        out: *const sparge_tensor_t,
        lse: *const sparge_tensor_t,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: *mut c_void,
    ) -> sparge_status_t;
    pub fn sparge_destroy_plan(plan: sparge_plan_t);
    pub fn sparge_last_error() -> *const c_char;
    pub fn sparge_status_string(status: sparge_status_t) -> *const c_char;
    pub fn sparge_version(major: *mut c_int, minor: *mut c_int, patch: *mut c_int);
    pub fn sparge_has_cuda() -> c_int;
    pub fn sparge_merge_states(
        count: i32,
        outs: *const sparge_tensor_t,
        lses: *const sparge_tensor_t,
        out: *const sparge_tensor_t,
        lse_out: *const sparge_tensor_t,
        stream: *mut c_void,
    ) -> sparge_status_t;
}

/// Most partial states one `sparge_merge_states` call combines.
pub const SPARGE_MERGE_MAX_STATES: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, offset_of, size_of};

    // The C layout on LP64 targets (x86_64, aarch64), worked out from the header.
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn struct_layout_matches_the_header() {
        assert_eq!(size_of::<sparge_tensor_t>(), 88);
        assert_eq!(size_of::<sparge_problem_t>(), 88);
        assert_eq!(size_of::<sparge_predict_params_t>(), 72);
        assert_eq!(align_of::<sparge_problem_t>(), 8);
        assert_eq!(offset_of!(sparge_tensor_t, shape), 24);
        assert_eq!(offset_of!(sparge_problem_t, dtype), 56);
        assert_eq!(offset_of!(sparge_problem_t, block_k), 84);
        assert_eq!(offset_of!(sparge_predict_params_t, topk_per_head), 32);
        assert_eq!(offset_of!(sparge_predict_params_t, pv_threshold), 56);
        assert_eq!(offset_of!(sparge_predict_params_t, local_window), 60);
        assert_eq!(offset_of!(sparge_predict_params_t, estimator), 64);
    }

    #[test]
    fn library_version_matches_these_declarations() {
        let (mut a, mut b, mut c) = (-1, -1, -1);
        unsafe { sparge_version(&mut a, &mut b, &mut c) };
        assert_eq!((a, b, c), (SPARGE_VERSION_MAJOR, SPARGE_VERSION_MINOR, SPARGE_VERSION_PATCH));
    }

    #[test]
    fn destroy_accepts_null_and_last_error_is_never_null() {
        unsafe {
            sparge_destroy_plan(core::ptr::null_mut());
            assert!(!sparge_last_error().is_null());
            assert!(!sparge_status_string(SPARGE_ERR_INTERNAL).is_null());
            assert!(!sparge_status_string(12345).is_null());
        }
    }
}
