use thiserror::Error;

/// Everything that can go wrong while describing or planning an attention problem.
///
/// Messages name the offending value and what the user can do about it, because these errors
/// usually come from a hand-written TOML workload or a command-line flag.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CoreError {
    #[error("invalid attention shape: {0}")]
    Shape(String),
    #[error("invalid KV tree: {0}")]
    Tree(String),
    #[error(
        "unknown workload `{name}`; known workloads: {known}. A path to a TOML file also works"
    )]
    UnknownWorkload { name: String, known: String },
    #[error("unknown planning method `{0}`; use q-guided, deft-node, deft-node-chunk, deft-flatten, fasttree or auto (and `all` where a command runs several)")]
    UnknownMethod(String),
    #[error("could not read workload file {path}: {reason}")]
    WorkloadFile { path: String, reason: String },
    #[error("invalid workload: {0}")]
    Workload(String),
    #[error("invalid plan: {0}")]
    Plan(String),
    #[error(
        "could not read device model {path}: {reason}. `canopy fit-model --out FILE` writes one"
    )]
    DeviceModelFile { path: String, reason: String },
    #[error("invalid sharding: {0}")]
    Shard(String),
}

pub type Result<T, E = CoreError> = std::result::Result<T, E>;
