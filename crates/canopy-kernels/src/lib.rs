//! # canopy-kernels
//!
//! canopy's CUDA kernel sources and the one registry of what is built from them. The sources
//! live in this crate (`cuda/*.cu`, with `cuda/common.cuh` prepended to each) and are embedded
//! in the binary; the CUDA backend compiles them at run time with NVRTC.
//!
//! A [`Variant`] is one compiled module: a source ([`Id`]) and the parameters it is built for
//! (element type, head dimension, rows, pipeline, merge depth). [`Variant::build`] gives
//! everything NVRTC needs for it (program name, text, options with the defines) and the name
//! its cubin is cached under; [`Kernel`] names one entry point of a variant, as the backend
//! loads and launches it; [`variants`] lists every variant that is compiled ahead of use. The
//! backend and `compile_all` both go through these, so the table of variants and defines
//! exists once.
//!
//! Every number the host and the kernels share (descriptor layouts, flags, thread counts,
//! tiles) is a Rust constant, here or in `canopy_core::geometry`, and reaches every compile as
//! a define ([`shared_defines`]); the sources only check that they were given one.
//!
//! The crate has no CUDA dependency: it is text and tables, tested on any machine.

mod constants;
mod pipeline;

pub use constants::{
    shared_defines, PrefillLaunch, ATTENTION_MAX_HEAD_DIM, CAUSAL_ROWS, CTA_PER_HEAD, CTA_WORDS,
    DECODE_THREADS, DEEP_MERGE_CTAS, GEMV_COLS, GEMV_MAX_ROWS, GEMV_WARPS, GROUP_KV_STREAMED,
    GROUP_WORDS, HEADS_STAGES, HEADS_TILE, LAYER_THREADS, MERGE_WARPS, MMA_ROW_PAD, MMA_THREADS,
    NORMED_GEMV_ROWS, PREFILL_CONSUMERS, PREFILL_ROWS, PREFILL_STAGES, PREFILL_TILE,
    PREFILL_WS_STAGES, REDUCE_MAX, REDUCE_SUM, RMS_NORM_CHUNKS, TOP_ITEMS, TOP_ROUNDS_MAX,
    WALK_BINS, WALK_CHUNK, WALK_THREADS, WIDE_MERGE_CTAS, WIDE_MERGE_DIMS, WIDE_MERGE_THREADS,
};
pub use pipeline::{MmaPipeline, MMA_HEAD_DIMS, MMA_STAGES, MMA_TILES};

use canopy_core::shape::SUPPORTED_HEAD_DIMS;
use canopy_core::DType;

/// The helpers every source is compiled with, prepended to it (NVRTC gets no include paths).
pub const COMMON: &str = include_str!("../cuda/common.cuh");

/// The warp-level tensor-core attention pieces, prepended after [`COMMON`] to the sources that
/// use them ([`Id::uses_mma`]).
pub const MMA: &str = include_str!("../cuda/mma.cuh");

/// Names a folder whose files replace the embedded sources of the same name (`layers.cu`,
/// `common.cuh`, ...) when set: kernels can be changed and timed without rebuilding the binary.
/// Cubins are cached by a hash of the text, so a changed file is compiled afresh.
pub const SOURCES_ENV: &str = "CANOPY_KERNEL_SOURCES";

/// The text of source `file`: the file of that name in [`SOURCES_ENV`]'s folder if there is
/// one, else the embedded `embedded`.
fn source_text(file: &str, embedded: &'static str) -> std::borrow::Cow<'static, str> {
    std::env::var_os(SOURCES_ENV)
        .and_then(|dir| std::fs::read_to_string(std::path::Path::new(&dir).join(file)).ok())
        .map_or(
            std::borrow::Cow::Borrowed(embedded),
            std::borrow::Cow::Owned,
        )
}

/// A kernel source file under `cuda/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Id {
    Decode,
    DecodeMma,
    Merge,
    Fill,
    Combine,
    Layers,
    Prefill,
}

/// Every source file.
pub const ALL_IDS: [Id; 7] = [
    Id::Decode,
    Id::DecodeMma,
    Id::Merge,
    Id::Fill,
    Id::Combine,
    Id::Layers,
    Id::Prefill,
];

impl Id {
    /// The file's name, which is also NVRTC's program name.
    pub fn file_name(self) -> &'static str {
        match self {
            Id::Decode => "decode.cu",
            Id::DecodeMma => "decode_mma.cu",
            Id::Merge => "merge.cu",
            Id::Fill => "fill.cu",
            Id::Combine => "combine.cu",
            Id::Layers => "layers.cu",
            Id::Prefill => "prefill.cu",
        }
    }

    /// The file's text (without [`COMMON`]).
    pub fn source(self) -> &'static str {
        match self {
            Id::Decode => include_str!("../cuda/decode.cu"),
            Id::DecodeMma => include_str!("../cuda/decode_mma.cu"),
            Id::Merge => include_str!("../cuda/merge.cu"),
            Id::Fill => include_str!("../cuda/fill.cu"),
            Id::Combine => include_str!("../cuda/combine.cu"),
            Id::Layers => include_str!("../cuda/layers.cu"),
            Id::Prefill => include_str!("../cuda/prefill.cu"),
        }
    }

    /// The files compiled after this one as one program, and their texts: the decode step's
    /// GEMVs and the ops on logits follow the layer kernels whose helpers they use.
    pub fn continuation(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Id::Layers => &[
                ("gemv.cu", include_str!("../cuda/gemv.cu")),
                ("logits.cu", include_str!("../cuda/logits.cu")),
                ("walks.cu", include_str!("../cuda/walks.cu")),
            ],
            _ => &[],
        }
    }

    /// The program's own text: the file and its [`Id::continuation`] (without [`COMMON`]).
    pub fn program_text(self) -> std::borrow::Cow<'static, str> {
        let own = source_text(self.file_name(), self.source());
        match self.continuation() {
            [] => own,
            files => std::iter::once(own)
                .chain(files.iter().map(|&(file, text)| source_text(file, text)))
                .collect::<Vec<_>>()
                .join("\n")
                .into(),
        }
    }

    /// Whether [`MMA`] is prepended to the file.
    pub fn uses_mma(self) -> bool {
        matches!(self, Id::DecodeMma | Id::Prefill)
    }

    /// The entry points (`extern "C" __global__`) the file defines.
    pub fn entries(self) -> &'static [&'static str] {
        match self {
            Id::Decode => &["decode_partial"],
            Id::DecodeMma => &["decode_partial_mma"],
            Id::Merge => &[
                "merge_partials",
                "merge_partials_rounded",
                "merge_partials_wide",
                "merge_partials_wide_rounded",
            ],
            Id::Fill => &["fill_random", "read16", "copy_pages"],
            Id::Combine => &[
                "combine_weights",
                "combine_finish",
                "combine_gathered",
                "combine_pair",
                "gather_rows",
                "reduce_slots",
                "peer_merge",
            ],
            Id::Layers => &[
                "round_to_elem",
                "embed_rows",
                "rms_norm",
                "rope_split",
                "rope_split_store",
                "swiglu",
                "swiglu_narrow",
                "store_kv",
                "load_kv",
                "causal_attention",
                "gemv",
                "gemv_add",
                "gemv_swiglu",
                "gemv_normed",
                "gemv_normed_swiglu",
                "gemv_rope",
                "top_logits",
                "logprob_terms",
                "softmax_totals",
                "pick_logits",
                "set_logits",
                "walk_masses",
                "walk_gather",
                "walk_select",
                "walk_sums",
                "walk_land",
            ],
            Id::Prefill => &["pack_keys", "gather_keys", "prefill_attention"],
        }
    }
}

/// Compile-time row counts of the CUDA-core decode kernel (`ROWS` in `decode.cu`).
pub const DECODE_ROWS: [usize; 4] = [1, 2, 4, 8];

/// The compile-time row count a plan needs: the smallest of [`DECODE_ROWS`] covering the
/// largest group's GQA rows (larger groups loop over rows in passes of 8).
pub fn rows_config(max_rows: usize) -> usize {
    DECODE_ROWS
        .into_iter()
        .find(|&r| r >= max_rows)
        .unwrap_or(DECODE_ROWS[DECODE_ROWS.len() - 1])
}

/// One compiled module: a source and the parameters it is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Variant {
    /// `decode_partial` on CUDA cores, for groups of up to `rows` GQA rows per pass.
    Decode {
        dtype: DType,
        head_dim: usize,
        rows: usize,
    },
    /// `decode_partial_mma` on tensor cores.
    DecodeMma {
        dtype: DType,
        head_dim: usize,
        pipeline: MmaPipeline,
    },
    /// `merge_partials`; `deep` keeps 8 rows' loads in flight per lane instead of 4. Both
    /// modules also hold `merge_partials_wide`, which no define changes.
    Merge { deep: bool },
    /// `fill_random` for KV of `dtype`, `read16` and `copy_pages`.
    Fill(DType),
    /// The cross-rank combine kernels (f32 states).
    Combine,
    /// The dense layers' kernels (fp32 activations) for weights and KV of `dtype`.
    Layers(DType),
    /// The prefill's attention on tensor cores, for KV of a 16-bit `dtype`.
    Prefill { dtype: DType, head_dim: usize },
}

/// `CANOPY_DTYPE`'s value for an element type (`common.cuh`), which kernels compiled for fp32
/// also take as an argument to write a 16-bit copy of their output (`round_to16`).
pub fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Bf16 => 2,
    }
}

/// What NVRTC compiles for one variant, and the name its cubin is cached under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Build {
    /// NVRTC's program name: the source file's.
    pub name: &'static str,
    /// [`COMMON`], [`MMA`] where the source uses it, then the source.
    pub text: String,
    /// The architecture, the language standard, then `-DNAME=value` per define.
    pub options: Vec<String>,
    /// `<source>-<arch>-<hash of text and options>.cubin`.
    pub cache_name: String,
}

impl Variant {
    pub fn id(&self) -> Id {
        match self {
            Variant::Decode { .. } => Id::Decode,
            Variant::DecodeMma { .. } => Id::DecodeMma,
            Variant::Merge { .. } => Id::Merge,
            Variant::Fill(_) => Id::Fill,
            Variant::Combine => Id::Combine,
            Variant::Layers(_) => Id::Layers,
            Variant::Prefill { .. } => Id::Prefill,
        }
    }

    /// The entry points the module holds.
    pub fn entries(&self) -> &'static [&'static str] {
        self.id().entries()
    }

    /// Every define NVRTC gets for this variant: its [`parameters`](Self::parameters), then
    /// the [`shared_defines`].
    pub fn defines(&self) -> Vec<(&'static str, String)> {
        let mut defines = self.parameters();
        defines.extend(shared_defines());
        defines
    }

    /// The defines that select this variant among its source's.
    pub fn parameters(&self) -> Vec<(&'static str, String)> {
        match *self {
            Variant::Decode {
                dtype,
                head_dim,
                rows,
            } => vec![
                ("CANOPY_DTYPE", dtype_code(dtype).to_string()),
                ("HEAD_DIM", head_dim.to_string()),
                ("ROWS", rows.to_string()),
            ],
            Variant::DecodeMma {
                dtype,
                head_dim,
                pipeline,
            } => [
                ("CANOPY_DTYPE", dtype_code(dtype).to_string()),
                ("HEAD_DIM", head_dim.to_string()),
            ]
            .into_iter()
            .chain(pipeline.defines())
            .collect(),
            Variant::Merge { deep } => vec![
                ("CANOPY_DTYPE", "0".into()),
                ("MERGE_DEPTH", if deep { "8" } else { "4" }.into()),
            ],
            Variant::Fill(dtype) => vec![("CANOPY_DTYPE", dtype_code(dtype).to_string())],
            Variant::Combine => vec![("CANOPY_DTYPE", "0".into())],
            Variant::Layers(dtype) => vec![("CANOPY_DTYPE", dtype_code(dtype).to_string())],
            Variant::Prefill { dtype, head_dim } => vec![
                ("CANOPY_DTYPE", dtype_code(dtype).to_string()),
                ("HEAD_DIM", head_dim.to_string()),
            ],
        }
    }

    /// The source, options and cache name of this variant for architecture `arch`
    /// (e.g. `sm_90a`).
    pub fn build(&self, arch: &str) -> Build {
        let id = self.id();
        let mma = if id.uses_mma() {
            source_text("mma.cuh", MMA)
        } else {
            std::borrow::Cow::Borrowed("")
        };
        let text = format!(
            "{}\n{mma}\n{}",
            source_text("common.cuh", COMMON),
            id.program_text()
        );
        let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
        options.extend(self.defines().iter().map(|(k, v)| format!("-D{k}={v}")));
        let key = canopy_core::stats::fnv1a(&[text.as_bytes(), options.join(" ").as_bytes()]);
        let stem = id.file_name().trim_end_matches(".cu");
        Build {
            name: id.file_name(),
            text,
            options,
            cache_name: format!("{stem}-{arch}-{key:016x}.cubin"),
        }
    }
}

/// One entry point of a [`Variant`]: what the backend loads and launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    Decode {
        dtype: DType,
        head_dim: usize,
        rows: usize,
    },
    DecodeMma {
        dtype: DType,
        head_dim: usize,
        pipeline: MmaPipeline,
    },
    /// `deep`: the variant that keeps more rows' loads in flight per lane; `rounded`: the entry
    /// that also writes the outputs rounded to a 16-bit dtype.
    Merge {
        deep: bool,
        rounded: bool,
    },
    /// `merge_partials_wide`: a CTA per cell and block of [`WIDE_MERGE_DIMS`] of its elements,
    /// for few cells of many rows (in the module of `Merge { deep: false }`); `rounded` as
    /// [`Kernel::Merge`]'s.
    MergeWide {
        rounded: bool,
    },
    Fill(DType),
    /// `read16`, the clean eviction's sweep (in the fill source).
    Read,
    /// `copy_pages`, paged KV to and from contiguous storage (in the fill source).
    CopyPages,
    /// One of [`Id::Combine`]'s entries, by name.
    Combine(&'static str),
    /// One of [`Id::Layers`]' entries, by name, for weights or KV of the dtype (the kernels
    /// that touch neither are in every dtype's module).
    Layers(DType, &'static str),
    /// One of [`Id::Prefill`]'s entries, by name.
    Prefill {
        dtype: DType,
        head_dim: usize,
        entry: &'static str,
    },
}

impl Kernel {
    /// The module the entry point is compiled in.
    pub fn variant(self) -> Variant {
        match self {
            Kernel::Decode {
                dtype,
                head_dim,
                rows,
            } => Variant::Decode {
                dtype,
                head_dim,
                rows,
            },
            Kernel::DecodeMma {
                dtype,
                head_dim,
                pipeline,
            } => Variant::DecodeMma {
                dtype,
                head_dim,
                pipeline,
            },
            Kernel::Merge { deep, .. } => Variant::Merge { deep },
            Kernel::MergeWide { .. } => Variant::Merge { deep: false },
            Kernel::Fill(dtype) => Variant::Fill(dtype),
            Kernel::Read | Kernel::CopyPages => Variant::Fill(DType::F32),
            Kernel::Combine(_) => Variant::Combine,
            Kernel::Layers(dtype, _) => Variant::Layers(dtype),
            Kernel::Prefill {
                dtype, head_dim, ..
            } => Variant::Prefill { dtype, head_dim },
        }
    }

    /// The kernel's entry point in its source.
    pub fn entry(self) -> &'static str {
        match self {
            Kernel::Decode { .. } => "decode_partial",
            Kernel::DecodeMma { .. } => "decode_partial_mma",
            Kernel::Merge { rounded: false, .. } => "merge_partials",
            Kernel::Merge { rounded: true, .. } => "merge_partials_rounded",
            Kernel::MergeWide { rounded: false } => "merge_partials_wide",
            Kernel::MergeWide { rounded: true } => "merge_partials_wide_rounded",
            Kernel::Combine(name) | Kernel::Layers(_, name) => name,
            Kernel::Prefill { entry, .. } => entry,
            Kernel::Fill(_) => "fill_random",
            Kernel::Read => "read16",
            Kernel::CopyPages => "copy_pages",
        }
    }
}

/// Every variant the backend can load, for every element type and supported head dimension;
/// the tensor-core kernel in its default pipeline only (others compile on first use).
pub fn variants() -> impl Iterator<Item = Variant> {
    let fixed = [
        Variant::Merge { deep: false },
        Variant::Merge { deep: true },
        Variant::Combine,
    ];
    let per_dtype = DType::ALL.into_iter().flat_map(|dtype| {
        let per_head_dim = SUPPORTED_HEAD_DIMS.into_iter().flat_map(move |head_dim| {
            let tensor_cores = dtype != DType::F32 && MMA_HEAD_DIMS.contains(&head_dim);
            let mma = tensor_cores.then_some([
                Variant::DecodeMma {
                    dtype,
                    head_dim,
                    pipeline: MmaPipeline::default(),
                },
                Variant::Prefill { dtype, head_dim },
            ]);
            let decode = DECODE_ROWS.into_iter().map(move |rows| Variant::Decode {
                dtype,
                head_dim,
                rows,
            });
            mma.into_iter().flatten().chain(decode)
        });
        [Variant::Fill(dtype), Variant::Layers(dtype)]
            .into_iter()
            .chain(per_head_dim)
    });
    fixed.into_iter().chain(per_dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Every kernel a variant holds is an `extern "C" __global__` function of its source.
    #[test]
    fn every_entry_is_defined_in_its_source() {
        for id in ALL_IDS {
            let text = id.program_text();
            for entry in id.entries() {
                let at = text
                    .find(&format!("{entry}("))
                    .unwrap_or_else(|| panic!("{entry} is not in {}", id.file_name()));
                let head = &text[..at];
                let decl = &head[head.rfind("extern \"C\"").expect("extern \"C\" before it")..];
                assert!(decl.contains("__global__"), "{entry} is not a kernel");
            }
        }
    }

    /// The names a text requires through `#ifndef NAME` / `#error` guards.
    fn guarded(text: &str) -> Vec<&str> {
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        lines
            .windows(2)
            .filter(|w| w[1].starts_with("#error"))
            .filter_map(|w| w[0].strip_prefix("#ifndef "))
            .map(str::trim)
            .collect()
    }

    /// Every variant's defines give every shared constant and every name its text guards.
    #[test]
    fn every_variant_defines_what_its_source_requires() {
        let shared: Vec<&str> = shared_defines().iter().map(|(k, _)| *k).collect();
        for v in variants() {
            let defines = v.defines();
            let names: HashSet<&str> = defines.iter().map(|(k, _)| *k).collect();
            assert_eq!(names.len(), defines.len(), "{v:?} defines a name twice");
            for name in &shared {
                assert!(names.contains(name), "{v:?} lacks {name}");
            }
            for name in guarded(&v.build("sm_90a").text) {
                assert!(names.contains(name), "{v:?} lacks {name}");
            }
        }
    }

    /// Every shared constant is required by some source: none is defined for nothing.
    #[test]
    fn every_shared_constant_is_guarded_in_a_source() {
        let continuations = ALL_IDS
            .iter()
            .flat_map(|id| id.continuation().iter().map(|f| f.1));
        let all: HashSet<&str> = [COMMON, MMA]
            .into_iter()
            .chain(ALL_IDS.map(Id::source))
            .chain(continuations)
            .flat_map(guarded)
            .collect();
        for (name, _) in shared_defines() {
            assert!(all.contains(name), "no source requires {name}");
        }
    }

    #[test]
    fn every_kernel_names_an_entry_of_its_variant() {
        let kernels = [
            Kernel::Decode {
                dtype: DType::Bf16,
                head_dim: 128,
                rows: 4,
            },
            Kernel::DecodeMma {
                dtype: DType::F16,
                head_dim: 64,
                pipeline: MmaPipeline::default(),
            },
            Kernel::Merge {
                deep: true,
                rounded: false,
            },
            Kernel::Merge {
                deep: false,
                rounded: true,
            },
            Kernel::MergeWide { rounded: false },
            Kernel::MergeWide { rounded: true },
            Kernel::Fill(DType::F16),
            Kernel::Read,
            Kernel::CopyPages,
        ]
        .into_iter()
        .chain(Id::Prefill.entries().iter().map(|&entry| Kernel::Prefill {
            dtype: DType::Bf16,
            head_dim: 128,
            entry,
        }))
        .chain(Id::Combine.entries().iter().map(|&e| Kernel::Combine(e)))
        .chain(
            Id::Layers
                .entries()
                .iter()
                .map(|&e| Kernel::Layers(DType::Bf16, e)),
        );
        for k in kernels {
            assert!(k.variant().entries().contains(&k.entry()), "{k:?}");
        }
    }

    /// Each variant compiles to its own cache file.
    #[test]
    fn no_two_variants_share_a_cache_name() {
        let names: Vec<String> = variants().map(|v| v.build("sm_90a").cache_name).collect();
        let unique: HashSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
        // 3 element types x (fill + layers + 3 head dims x 4 row counts) + 2 x 2 x (decode and
        // prefill) tensor-core modules + 2 merges + combine.
        assert_eq!(names.len(), 53);
    }

    #[test]
    fn every_source_file_is_a_variant_s() {
        let ids: HashSet<Id> = variants().map(|v| v.id()).collect();
        assert_eq!(ids, ALL_IDS.into_iter().collect());
    }

    /// `merge_partials_wide` splits every head into whole blocks of its dims.
    #[test]
    fn wide_merge_blocks_tile_every_head_dim() {
        for head_dim in SUPPORTED_HEAD_DIMS {
            assert_eq!(head_dim % WIDE_MERGE_DIMS, 0, "head dim {head_dim}");
        }
    }

    #[test]
    fn rows_config_covers_gqa_rows() {
        assert_eq!(rows_config(1), 1);
        assert_eq!(rows_config(3), 4);
        assert_eq!(rows_config(8), 8);
        assert_eq!(rows_config(4096), 8);
    }

    #[test]
    fn default_pipeline_is_supported() {
        assert!(MmaPipeline::default().is_supported());
        assert!(!MmaPipeline {
            tile: 48,
            stages: 4
        }
        .is_supported());
    }
}
