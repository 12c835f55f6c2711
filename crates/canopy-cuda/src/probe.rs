//! Finding out what GPUs, driver, NVRTC and NCCL this machine has, without ever panicking:
//! cudarc loads the libraries on first use and panics if they are missing, so every entry
//! point first checks that the library can be loaded.

use crate::error::{CudaError, DriverContext, Result};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::CudaContext;
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub memory_bytes: u64,
    pub multiprocessors: u32,
    pub l2_bytes: u64,
    pub compute_capability: (i32, i32),
}

impl GpuInfo {
    /// Reads the properties of the GPU behind `ctx`.
    pub fn read(ctx: &CudaContext) -> Result<GpuInfo> {
        Ok(GpuInfo {
            ordinal: ctx.ordinal(),
            name: ctx.name().ctx("cuDeviceGetName")?,
            memory_bytes: ctx.total_mem().ctx("cuDeviceTotalMem")? as u64,
            multiprocessors: ctx
                .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .ctx("cuDeviceGetAttribute")? as u32,
            l2_bytes: ctx
                .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
                .ctx("cuDeviceGetAttribute")? as u64,
            compute_capability: ctx.compute_capability().ctx("cuDeviceGetAttribute")?,
        })
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct CudaInfo {
    /// e.g. "13.0"
    pub driver_version: String,
    pub nvrtc_version: Option<String>,
    pub nccl_version: Option<String>,
    pub gpus: Vec<GpuInfo>,
}

/// Whether libcuda can be loaded (never panics).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether libnvrtc can be loaded (never panics).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether libnccl can be loaded (never panics).
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

fn version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

pub(crate) fn nvrtc_version() -> Option<String> {
    if !nvrtc_present() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; the call writes two ints.
    let ok = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (ok == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then(|| format!("{major}.{minor}"))
}

fn nccl_version() -> Option<String> {
    if !nccl_present() {
        return None;
    }
    let mut v = 0;
    // SAFETY: the library is present; the call writes one int.
    let ok = unsafe { cudarc::nccl::sys::ncclGetVersion(&mut v) };
    (ok == cudarc::nccl::sys::ncclResult_t::ncclSuccess)
        .then(|| format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
}

/// Number of visible GPUs, or why there are none.
pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    cudarc::driver::result::init().ctx("cuInit")?;
    let n = CudaContext::device_count().ctx("cuDeviceGetCount")?;
    if n <= 0 {
        return Err(CudaError::NoDevice(n));
    }
    Ok(n as usize)
}

/// Everything `canopy info` shows about CUDA.
pub fn probe() -> Result<CudaInfo> {
    let count = device_count()?;
    let mut v = 0;
    // SAFETY: the driver is loaded (device_count checked); the call writes one int.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }
        .result()
        .ctx("cuDriverGetVersion")?;
    let mut gpus = Vec::with_capacity(count);
    for ordinal in 0..count {
        let ctx = CudaContext::new(ordinal).ctx(format!("creating a context on GPU {ordinal}"))?;
        gpus.push(GpuInfo::read(&ctx)?);
    }
    Ok(CudaInfo {
        driver_version: version(v),
        nvrtc_version: nvrtc_version(),
        nccl_version: nccl_version(),
        gpus,
    })
}
