//! Run-time compilation of the registry's kernel variants ([`canopy_kernels`]) with NVRTC,
//! straight to a cubin for the device's architecture (`sm_90a` on Hopper, so Hopper-only
//! instructions are available), cached on disk under the name the registry gives (source,
//! architecture, hash of text and options). A compile error carries NVRTC's log.

use crate::error::{CudaError, Result};
use crate::probe::nvrtc_present;
use canopy_kernels::{variants, Variant};
use cudarc::nvrtc::{result as nvrtc, sys};
use std::ffi::{CStr, CString};
use std::path::PathBuf;

/// The architecture NVRTC targets for compute capability `cc`.
pub fn arch_for(cc: (i32, i32)) -> String {
    match cc {
        (9, 0) => "sm_90a".into(),
        (major, minor) => format!("sm_{major}{minor}"),
    }
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("CANOPY_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("canopy").join("kernels"))
}

/// Compiles `variant` for `arch`, or loads the cached cubin.
pub fn cubin(variant: &Variant, arch: &str) -> Result<Vec<u8>> {
    let build = variant.build(arch);
    let kernel = build.name;
    let path = cache_dir().map(|d| d.join(&build.cache_name));
    if let Some(bytes) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        tracing::debug!(kernel, "kernel cache hit");
        return Ok(bytes);
    }
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let t0 = std::time::Instant::now();
    let bytes = compile(kernel, &build.text, &build.options)?;
    tracing::info!(kernel, ms = t0.elapsed().as_millis() as u64, options = ?build.options, cache = ?path, "compiled with NVRTC");
    if let Some(p) = &path {
        // The cache is an optimisation: failing to write it is not an error.
        let _ = p.parent().map(std::fs::create_dir_all);
        // A name of its own per write: threads of one process (ranks sharing a GPU) may
        // compile the same variant at once, and the rename then publishes whole files only.
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = p.with_extension(format!("tmp{}-{n}", std::process::id()));
        if std::fs::write(&tmp, &bytes).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(bytes)
}

fn compile(name: &str, text: &str, options: &[String]) -> Result<Vec<u8>> {
    let err = |log: String| CudaError::Compile {
        kernel: name.into(),
        options: options.join(" "),
        log,
    };
    let src = CString::new(text).map_err(|_| err("the source contains a NUL byte".into()))?;
    let cname = CString::new(name).expect("kernel names have no NUL");
    let prog = nvrtc::create_program(&src, Some(&cname)).map_err(|e| err(format!("{e:?}")))?;
    // SAFETY: `prog` is a live program; every call below only reads or writes through it.
    let result = unsafe {
        match nvrtc::compile_program(prog, options) {
            Ok(()) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| err(format!("nvrtcGetCUBINSize: {e:?}")))?;
                let mut cubin = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                    .result()
                    .map_err(|e| err(format!("nvrtcGetCUBIN: {e:?}")))?;
                // Warnings that cost speed, not correctness (ptxas serialising warpgroup
                // MMAs, say) come only in the log.
                if let Ok(log) = nvrtc::get_program_log(prog) {
                    let log = CStr::from_ptr(log.as_ptr()).to_string_lossy();
                    if !log.trim().is_empty() {
                        tracing::warn!(kernel = name, log = %log.trim(), "NVRTC's warnings");
                    }
                }
                Ok(cubin)
            }
            Err(e) => {
                let log = nvrtc::get_program_log(prog)
                    .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned());
                Err(err(format!("{e:?}\n{}", log.unwrap_or_default())))
            }
        }
    };
    // SAFETY: destroyed once, after its last use.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

/// Compiles every variant of the registry ([`canopy_kernels::variants`]) for `arch` into the
/// cache (or `CANOPY_KERNEL_CACHE`): a check that needs NVRTC but no GPU, and a way to inspect
/// the SASS off the device.
pub fn compile_all(arch: &str) -> Result<Vec<String>> {
    variants()
        .map(|variant| {
            cubin(&variant, arch)?;
            let d: Vec<String> = variant
                .parameters()
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            Ok(format!("{} {}", variant.id().file_name(), d.join(" ")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names() {
        assert_eq!(arch_for((9, 0)), "sm_90a");
        assert_eq!(arch_for((8, 6)), "sm_86");
    }
}
