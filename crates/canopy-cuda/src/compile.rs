//! Run-time compilation of `kernels/*.cu` with NVRTC, straight to a cubin for the device's
//! architecture (`sm_90a` on Hopper, so Hopper-only instructions are available), cached on
//! disk under a key of source hash + architecture + options. A compile error carries NVRTC's
//! log.

use crate::error::{CudaError, Result};
use crate::probe::nvrtc_present;
use cudarc::nvrtc::{result as nvrtc, sys};
use std::ffi::{CStr, CString};
use std::path::PathBuf;

const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// A kernel source file under `kernels/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    Decode,
    DecodeMma,
    Merge,
    Fill,
    Combine,
}

impl Source {
    fn name(self) -> &'static str {
        match self {
            Source::Decode => "decode.cu",
            Source::DecodeMma => "decode_mma.cu",
            Source::Merge => "merge.cu",
            Source::Fill => "fill.cu",
            Source::Combine => "combine.cu",
        }
    }

    fn text(self) -> &'static str {
        match self {
            Source::Decode => include_str!("../../../kernels/decode.cu"),
            Source::DecodeMma => include_str!("../../../kernels/decode_mma.cu"),
            Source::Merge => include_str!("../../../kernels/merge.cu"),
            Source::Fill => include_str!("../../../kernels/fill.cu"),
            Source::Combine => include_str!("../../../kernels/combine.cu"),
        }
    }
}

/// Head dimensions the tensor-core kernel is built for (its accumulators for 256 would not fit
/// in registers beside the score tile).
pub const MMA_HEAD_DIMS: [usize; 2] = [64, 128];

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

/// Compiles `source` with `defines` for `arch`, or loads the cached cubin.
pub fn cubin(source: Source, arch: &str, defines: &[(&str, String)]) -> Result<Vec<u8>> {
    let text = format!("{COMMON}\n{}", source.text());
    let mut options: Vec<String> = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    options.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    let key = canopy_core::stats::fnv1a(&[text.as_bytes(), options.join(" ").as_bytes()]);
    let path = cache_dir().map(|d| {
        d.join(format!(
            "{}-{arch}-{key:016x}.cubin",
            source.name().trim_end_matches(".cu")
        ))
    });
    if let Some(bytes) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        tracing::debug!(kernel = source.name(), "kernel cache hit");
        return Ok(bytes);
    }
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let t0 = std::time::Instant::now();
    let bytes = compile(source.name(), &text, &options)?;
    tracing::info!(kernel = source.name(), ms = t0.elapsed().as_millis() as u64, ?options, cache = ?path, "compiled with NVRTC");
    if let Some(p) = &path {
        // The cache is an optimisation: failing to write it is not an error.
        let _ = p.parent().map(std::fs::create_dir_all);
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
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

/// Every kernel variant the backend can load, as (source, defines).
pub fn all_variants() -> Vec<(Source, Vec<(&'static str, String)>)> {
    let codes = [("0", "f32"), ("1", "f16"), ("2", "bf16")];
    let mut out = vec![
        (Source::Merge, crate::backend::merge_defines(false)),
        (Source::Merge, crate::backend::merge_defines(true)),
        (Source::Combine, vec![("CANOPY_DTYPE", "0".to_string())]),
    ];
    for (code, _) in codes {
        out.push((Source::Fill, vec![("CANOPY_DTYPE", code.to_string())]));
        for head_dim in canopy_core::shape::SUPPORTED_HEAD_DIMS {
            if code != "0" && MMA_HEAD_DIMS.contains(&head_dim) {
                // The default pipeline; others compile on first use.
                let pipeline = crate::backend::MmaPipeline::default();
                out.push((
                    Source::DecodeMma,
                    [
                        ("CANOPY_DTYPE", code.to_string()),
                        ("HEAD_DIM", head_dim.to_string()),
                    ]
                    .into_iter()
                    .chain(pipeline.defines())
                    .collect(),
                ));
            }
            for rows in [1, 2, 4, 8] {
                out.push((
                    Source::Decode,
                    vec![
                        ("CANOPY_DTYPE", code.to_string()),
                        ("HEAD_DIM", head_dim.to_string()),
                        ("ROWS", rows.to_string()),
                    ],
                ));
            }
        }
    }
    out
}

/// Compiles every variant for `arch` into the cache (or `CANOPY_KERNEL_CACHE`): a check that
/// needs NVRTC but no GPU, and a way to inspect the SASS off the device.
pub fn compile_all(arch: &str) -> Result<Vec<String>> {
    all_variants()
        .into_iter()
        .map(|(src, defines)| {
            cubin(src, arch, &defines)?;
            let d: Vec<String> = defines.iter().map(|(k, v)| format!("{k}={v}")).collect();
            Ok(format!("{} {}", src.name(), d.join(" ")))
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
