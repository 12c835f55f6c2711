//! `canopy` started as if by mpirun: the launcher's variables are set in the child's
//! environment only. A build without MPI refuses every command rather than run it once per
//! process (`info` excepted); the MPI build still refuses the commands with no MPI path.

use assert_cmd::Command;
use predicates::str::contains;

/// Every variable that names a launcher, cleared so that a test run under one (a CI job in
/// an srun step) sees only the variables it sets.
const LAUNCHER_VARS: [&str; 9] = [
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "PMI_SIZE",
    "PMI_RANK",
    "PMIX_RANK",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
];

/// `canopy` started by no launcher.
fn canopy() -> Command {
    let mut cmd = Command::cargo_bin("canopy").expect("the canopy binary is built");
    for var in LAUNCHER_VARS {
        cmd.env_remove(var);
    }
    cmd
}

/// `canopy` as one of four ranks that Open MPI's mpirun started.
fn rank_of_four() -> Command {
    let mut cmd = canopy();
    cmd.env("OMPI_COMM_WORLD_SIZE", "4")
        .env("OMPI_COMM_WORLD_RANK", "0");
    cmd
}

/// The MPI build would start an MPI rank here instead.
#[cfg(not(feature = "mpi"))]
#[test]
fn bench_attention_without_mpi_is_refused_under_mpirun() {
    rank_of_four()
        .args([
            "bench",
            "attention",
            "--backend",
            "cpu",
            "--seq-len",
            "1024",
            "--iters",
            "1",
        ])
        .assert()
        .failure()
        .stdout("")
        .stderr(contains("--features mpi"))
        .stderr(contains("started 4 processes"));
}

#[test]
fn launcher_threads_is_refused_under_mpirun() {
    rank_of_four()
        .args([
            "bench",
            "attention",
            "--launcher",
            "threads",
            "--backend",
            "cpu",
            "--seq-len",
            "1024",
            "--iters",
            "1",
        ])
        .assert()
        .failure()
        .stdout("")
        .stderr(contains("--ranks P"));
}

#[test]
fn commands_without_an_mpi_path_are_refused_under_mpirun() {
    rank_of_four()
        .args(["plan", "--workload", "fasttree-0"])
        .assert()
        .failure()
        .stdout("")
        .stderr(contains("`canopy plan` runs in one process"))
        .stderr(contains("bench attention"));
}

#[test]
fn info_runs_under_mpirun() {
    rank_of_four()
        .arg("info")
        .assert()
        .success()
        .stdout(contains("cpu:"));
}

#[test]
fn one_process_or_an_allocation_is_no_launcher() {
    canopy()
        .env("OMPI_COMM_WORLD_SIZE", "1")
        .env("OMPI_COMM_WORLD_RANK", "0")
        .args(["plan", "--workload", "fasttree-0"])
        .assert()
        .success();
    canopy()
        .env("SLURM_JOB_ID", "123")
        .args(["plan", "--workload", "fasttree-0"])
        .assert()
        .success();
}
