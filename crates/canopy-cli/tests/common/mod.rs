//! Helpers the integration tests share (each test file uses some of them).
#![allow(dead_code)]

use assert_cmd::Command;

/// The `canopy` binary this package built.
pub fn canopy() -> Command {
    Command::cargo_bin("canopy").expect("the canopy binary is built")
}

/// The path of the tiny random Llama `variant` of `tests/fixtures/tiny/`.
pub fn tiny_model(variant: &str) -> String {
    format!(
        "{}/../../tests/fixtures/tiny/{variant}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// The path of SmolLM2-135M-Instruct in the model cache, fetched there first if it is not
/// cached and `CANOPY_TEST_FETCH=1` (as CI sets it); `None` otherwise, when the tests that
/// need it say so and pass. The same rule as `canopy-runtime`'s `tests/smollm2.rs`.
pub fn smollm2_path() -> Option<std::path::PathBuf> {
    let cached = canopy_model::cache_dir()
        .ok()?
        .join(canopy_model::DEFAULT_MODEL_FILE);
    if cached.is_file() {
        Some(cached)
    } else if std::env::var("CANOPY_TEST_FETCH").is_ok_and(|v| v == "1") {
        Some(canopy_model::default_model().expect("fetching SmolLM2"))
    } else {
        eprintln!(
            "note: {} is not cached; skipping (run `canopy generate` once, or set CANOPY_TEST_FETCH=1)",
            cached.display()
        );
        None
    }
}

/// What `cmd` prints on success, parsed as JSON.
pub fn json_output(cmd: &mut Command) -> serde_json::Value {
    let out = cmd.assert().success().get_output().stdout.clone();
    serde_json::from_slice(&out).expect("valid JSON")
}

/// Whether plot labels can be drawn here: `CANOPY_FONT`, or one of the fonts `canopy` looks
/// for without it.
pub fn font() -> bool {
    std::env::var_os("CANOPY_FONT").is_some()
        || [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
        ]
        .into_iter()
        .any(|f| std::path::Path::new(f).exists())
}
pub mod serve;
