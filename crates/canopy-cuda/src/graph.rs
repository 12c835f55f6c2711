//! A decode pass recorded as one CUDA graph and replayed.
//!
//! A pass's hundreds of launches cost the host more than the GPU needs for a small model's
//! step; a graph replays them in one launch. The pass is captured from the backend's stream as
//! it runs, so the graph holds every pointer and scalar its kernels were given. Replaying it
//! is right only while those still name this step's data:
//!
//! - the activations a pass makes and frees are the graph's own memory (stream-ordered
//!   allocations captured as graph nodes), at the same addresses every replay;
//! - the step's token ids, positions and KV slots are staged before the replay into the step
//!   input buffers the pass read ([`LayerOps::stage_step`](canopy_engine::LayerOps)), written
//!   in place;
//! - the attention's plans, states and merge buffers belong to its
//!   [`RankAttention`](canopy_engine::RankAttention), whose generation moves when it makes
//!   one anew (a plan written over one in place keeps its buffers);
//! - everything else a pass reads (KV pools and page tables, the step inputs, the GEMM
//!   scratch) is made outside the pass, and making one anew moves the backend's
//!   [`GraphState::epoch`].
//!
//! The caller keys a recording by the epoch and the generation, and records again when
//! either moved.
//!
//! While a capture runs, an op that would upload from the host or make a lasting buffer
//! fails instead ([`CudaBackend::refuse_while_capturing`]), so a pass that cannot be replayed
//! is never recorded.

use crate::backend::CudaBackend;
use crate::error::{CudaError, DriverContext, Result};
use cudarc::driver::sys::{
    self, CUgraph, CUgraphInstantiate_flags, CUgraphNode, CUgraphNodeType, CUstreamCaptureMode,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Whether a capture is running, and the epoch of the buffers recorded passes read.
#[derive(Debug, Default)]
pub(crate) struct GraphState {
    capturing: AtomicBool,
    epoch: AtomicU64,
}

/// A recorded decode pass, instantiated and uploaded to the device.
pub struct CudaGraph(cudarc::driver::CudaGraph);

// SAFETY: a graph is used only by the backend that recorded it, whose one stream serializes
// its launches; moving it between threads is allowed (CUDA asks that calls on one graph not be
// concurrent, and `replay` takes it by shared reference from one owner at a time).
unsafe impl Send for CudaGraph {}

impl CudaBackend {
    /// The epoch of the buffers recorded passes read.
    pub(crate) fn graph_epoch_now(&self) -> u64 {
        self.graph.epoch.load(Ordering::SeqCst)
    }

    /// A buffer a recorded pass may read is being made anew (`what`): recordings made before
    /// are stale, and none may be running.
    pub(crate) fn renew(&self, what: &str) -> Result<()> {
        self.refuse_while_capturing(what)?;
        let epoch = self.graph.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        tracing::debug!(
            what,
            epoch,
            "recorded passes are stale: a buffer they read is made anew"
        );
        Ok(())
    }

    /// Whether a capture is running on this backend.
    pub(crate) fn capturing(&self) -> bool {
        self.graph.capturing.load(Ordering::SeqCst)
    }

    /// An error if a capture is running: `what` would bake host data or a lasting buffer into
    /// the recording.
    pub(crate) fn refuse_while_capturing(&self, what: &str) -> Result<()> {
        if self.capturing() {
            return Err(CudaError::Unsupported(format!(
                "{what} inside a recorded decode pass: stage the step's inputs before recording"
            )));
        }
        Ok(())
    }

    pub(crate) fn begin_capture(&self) -> Result<()> {
        self.refuse_while_capturing("a second recording")?;
        // Thread-local: calls from this thread that are unsafe under capture fail it, other
        // threads (ranks sharing the GPU) are not affected.
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .ctx("cuStreamBeginCapture")?;
        self.graph.capturing.store(true, Ordering::SeqCst);
        Ok(())
    }

    pub(crate) fn end_capture(&self) -> Result<CudaGraph> {
        self.graph.capturing.store(false, Ordering::SeqCst);
        let graph = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .ctx("cuStreamEndCapture")?
            .ok_or_else(|| CudaError::Unsupported("the recorded decode pass was empty".into()))?;
        graph.upload().ctx("cuGraphUpload")?;
        if tracing::enabled!(tracing::Level::DEBUG) {
            let census = node_census(graph.cu_graph())?;
            tracing::debug!(nodes = ?census, "recorded a decode pass");
        }
        Ok(CudaGraph(graph))
    }

    pub(crate) fn replay(&self, graph: &CudaGraph) -> Result<()> {
        graph.0.launch().ctx("cuGraphLaunch")
    }
}

/// How many nodes of each type a graph holds: a replay's host cost grows with them.
fn node_census(graph: CUgraph) -> Result<Vec<(CUgraphNodeType, usize)>> {
    let mut count = 0usize;
    // SAFETY: a null node array asks for the count alone.
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) }
        .result()
        .ctx("cuGraphGetNodes")?;
    let mut nodes: Vec<CUgraphNode> = vec![std::ptr::null_mut(); count];
    // SAFETY: `nodes` holds `count` entries, the count the graph reported.
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count) }
        .result()
        .ctx("cuGraphGetNodes")?;
    let mut census: Vec<(CUgraphNodeType, usize)> = Vec::new();
    for node in &nodes[..count] {
        let mut kind = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` is one of the graph's nodes.
        unsafe { sys::cuGraphNodeGetType(*node, &mut kind) }
            .result()
            .ctx("cuGraphNodeGetType")?;
        match census.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => census.push((kind, 1)),
        }
    }
    Ok(census)
}
