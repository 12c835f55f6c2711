//! # canopy-cuda
//!
//! The CUDA backend of canopy's engine, on [`cudarc`] with dynamic loading: the binary builds
//! and runs on machines without CUDA, and every entry point checks that the driver and NVRTC can
//! be loaded (cudarc panics on first use otherwise) and returns [`CudaError`] with what to do.
//!
//! Kernels live in the `canopy-kernels` crate, whose registry says which variants exist and
//! with which defines; they are embedded in the binary, compiled at run time by NVRTC for the
//! device's architecture (`sm_90a` on Hopper) and cached on disk ([`compile`]).
//!
//! [`CudaBackend`] implements the engine's `Backend` trait (`backend`): KV storage, contiguous
//! or paged (`kv`), plan upload, re-split so one balanced wave of CTAs fills the GPU and laid
//! out as the kernels' descriptors (`descriptors`), the split-KV flash-decoding partial kernel
//! and the deterministic CSR merge, loaded and launched by `launch`; `timing` holds the CUDA
//! event timings, L2 eviction and copy bandwidth. It also implements the engine's `LayerOps`
//! (`layers`): a model's dense layers on fp32 activations and bf16, f16 or f32 weights, the
//! GEMMs on cuBLAS.
//!
//! Between ranks it gives the engine two device transports: [`NcclTransport`] (one GPU per
//! rank; [`nccl`] holds the watched communicators) and [`DeviceWorld`] (ranks sharing one GPU,
//! for tests). [`distributed`] runs the engine's attention benchmark over NCCL.

mod backend;
pub mod bench;
pub mod compile;
mod descriptors;
mod device_world;
pub mod distributed;
mod error;
mod graph;
mod kv;
mod launch;
mod layers;
mod merge_ops;
pub mod nccl;
mod nccl_transport;
mod peer_memory;
mod peer_merge;
mod peer_ring;
pub mod probe;
mod settings;
mod staging;
mod timing;

pub use backend::{CudaBackend, CudaQueries, CudaStates, KernelChoice};
pub use canopy_kernels::MmaPipeline;
pub use descriptors::CudaPlan;
pub use device_world::{DeviceComm, DeviceWorld};
pub use error::{CudaError, Result};
pub use graph::CudaGraph;
pub use kv::CudaKv;
pub use launch::KernelResources;
pub use layers::{CudaTensor, CudaWeight};
pub use nccl_transport::{NcclIds, NcclTransport};
pub use peer_merge::PEER_MERGE_SWITCH;
pub use peer_ring::PEER_RING_SWITCH;
pub use probe::{probe, CudaInfo, GpuInfo};
pub use settings::KernelSettings;
