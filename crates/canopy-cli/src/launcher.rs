//! Which multi-process launcher started this process, read from the variables it sets.
//!
//! `mpirun -np 4 canopy bench attention` starts four processes. One that ignored its launcher
//! would run the whole job as threads and print its own document, four in all. So `bench
//! attention` and `bench scaling` run one rank per process over MPI by default under a
//! launcher, and the commands with no MPI path refuse to run there.
//!
//! A launcher that started one process (`mpirun -np 1`, or the shell of `srun --pty bash`)
//! counts as none: one process prints one document whatever it does.
//!
//! [`detect`] reads the environment through a lookup closure, so its tests never touch the
//! process environment.

use crate::bench::Launcher;
use anyhow::{bail, Result};
use std::fmt;

/// The launchers recognised, each by the variables it sets in every process it starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Open MPI's `mpirun` or `mpiexec`: `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_RANK`.
    OpenMpi,
    /// A PMI launcher (MPICH's Hydra `mpiexec`, Intel MPI, `srun --mpi=pmi2`): `PMI_SIZE`,
    /// `PMI_RANK`.
    Pmi,
    /// Slurm's `srun`: `SLURM_STEP_ID` with `SLURM_PROCID` or a task count. `SLURM_JOB_ID`
    /// alone is set in every process of an allocation (an `sbatch` script, an `salloc` shell)
    /// and says nothing about how many copies of canopy run.
    Srun,
    /// A PMIx server that none of the above describes: `PMIX_RANK`, and no world size.
    Pmix,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::OpenMpi => "mpirun (Open MPI)",
            Kind::Pmi => "mpiexec (PMI)",
            Kind::Srun => "srun",
            Kind::Pmix => "a PMIx launcher",
        })
    }
}

/// A launcher that started this process, how many processes it started and which of them
/// this one is, where known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub kind: Kind,
    pub size: Option<usize>,
    pub rank: Option<usize>,
}

impl Launch {
    /// Whether other processes may be running the same command line beside this one.
    fn is_multi(&self) -> bool {
        self.size != Some(1)
    }

    /// "mpirun (Open MPI) started 4 processes", for messages.
    fn started(&self) -> String {
        match self.size {
            Some(n) => format!("{} started {n} processes", self.kind),
            None => format!("{} started this process among others", self.kind),
        }
    }
}

/// The launcher that started this process, read through `var` (an environment lookup).
///
/// The MPI launchers are checked before Slurm: Open MPI's `mpirun` and MPICH's `mpiexec`
/// inside an allocation start their daemons with `srun`, so their ranks inherit the daemons'
/// `SLURM_STEP_ID` and task count (one task per node), and only the MPI variables give the
/// world size.
pub fn detect(var: impl Fn(&str) -> Option<String>) -> Option<Launch> {
    let value = |name: &str| var(name).filter(|v| !v.trim().is_empty());
    let set = |name: &str| value(name).is_some();
    // The first of `names` that is set, as a count; `None` (size unknown) if it is no number.
    let count = |names: &[&str]| {
        names
            .iter()
            .find_map(|name| value(name))
            .and_then(|v| v.trim().parse().ok())
    };
    let (kind, size, rank) = if set("OMPI_COMM_WORLD_SIZE") || set("OMPI_COMM_WORLD_RANK") {
        (
            Kind::OpenMpi,
            count(&["OMPI_COMM_WORLD_SIZE"]),
            count(&["OMPI_COMM_WORLD_RANK"]),
        )
    } else if set("PMI_SIZE") || set("PMI_RANK") {
        (Kind::Pmi, count(&["PMI_SIZE"]), count(&["PMI_RANK"]))
    } else if set("SLURM_STEP_ID")
        && ["SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"]
            .iter()
            .any(|name| set(name))
    {
        // `srun` sets the step's task count in both; `SLURM_NTASKS` alone may be the
        // allocation's.
        (
            Kind::Srun,
            count(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"]),
            count(&["SLURM_PROCID"]),
        )
    } else if set("PMIX_RANK") {
        (Kind::Pmix, None, count(&["PMIX_RANK"]))
    } else {
        return None;
    };
    Some(Launch { kind, size, rank })
}

/// The launcher that started this process, from its environment.
pub fn from_env() -> Option<Launch> {
    detect(|name| std::env::var(name).ok())
}

/// Prints `note: {message}` to stderr, once a job: from a process no launcher started, or
/// from the launcher's rank 0 (or a rank it does not number). Under `mpirun -np 8` the other
/// processes keep quiet, as they do for the job's results.
pub fn note(message: impl fmt::Display) {
    if from_env().and_then(|l| l.rank).is_none_or(|rank| rank == 0) {
        eprintln!("note: {message}");
    }
}

/// How `bench attention` and `bench scaling` start their ranks: `flag` (`--launcher`) if
/// given, else MPI under a launcher that started several processes and threads otherwise.
///
/// Threads under such a launcher are refused rather than run on rank 0 alone: the launcher
/// would hold the other processes (and their GPUs) idle, and the result would not be the
/// P-process run the user asked mpirun for.
pub fn choose(flag: Option<Launcher>, launch: Option<Launch>, mpi_built: bool) -> Result<Launcher> {
    let Some(launch) = launch.filter(Launch::is_multi) else {
        return Ok(flag.unwrap_or(Launcher::Threads));
    };
    let without = match launch.kind {
        Kind::Srun => "srun",
        _ => "mpirun",
    };
    match (flag, mpi_built) {
        (Some(Launcher::Mpi), _) | (None, true) => Ok(Launcher::Mpi),
        (Some(Launcher::Threads), true) => bail!(
            "`--launcher threads` runs every rank as a thread of one process, but {}: each \
             would run the whole job and print it. Drop `--launcher threads` to run one rank \
             per process over MPI, or run canopy once, without {without}, with `--ranks P` for \
             P ranks",
            launch.started()
        ),
        (Some(Launcher::Threads), false) | (None, false) => bail!(
            "{}, but this canopy was built without MPI, so each would run the whole job as \
             threads and print it. Build with MPI to run one rank per process: `cargo build \
             --release -p canopy-cli --features mpi` (needs OpenMPI and libclang); or run \
             canopy once, without {without}, with `--ranks P` for P ranks as threads",
            launch.started()
        ),
    }
}

/// Refuses `command`, which has no MPI path, under a launcher that started several
/// processes: each would run it and print its own copy.
pub fn refuse_copies(command: &str, launch: Option<Launch>) -> Result<()> {
    match launch.filter(Launch::is_multi) {
        Some(launch) => bail!(
            "`canopy {command}` runs in one process, but {}, which would each run it and print \
             it: run it without mpirun or srun. Under mpirun or srun, only `bench attention` \
             and `bench scaling` run (one rank per process)",
            launch.started()
        ),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detect_in(vars: &[(&str, &str)]) -> Option<Launch> {
        detect(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        })
    }

    fn launch(kind: Kind, size: Option<usize>, rank: Option<usize>) -> Option<Launch> {
        Some(Launch { kind, size, rank })
    }

    #[test]
    fn no_launcher_variables_is_no_launcher() {
        assert_eq!(detect_in(&[]), None);
        assert_eq!(detect_in(&[("HOME", "/root"), ("OMPI_MCA_foo", "1")]), None);
    }

    #[test]
    fn open_mpi_gives_its_world_size() {
        let vars = [("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_RANK", "2")];
        assert_eq!(detect_in(&vars), launch(Kind::OpenMpi, Some(4), Some(2)));
        // A rank without the size still is a rank; its world size is unknown.
        let vars = [("OMPI_COMM_WORLD_RANK", "0")];
        assert_eq!(detect_in(&vars), launch(Kind::OpenMpi, None, Some(0)));
    }

    #[test]
    fn pmi_gives_its_world_size() {
        let vars = [("PMI_SIZE", "8"), ("PMI_RANK", "7")];
        assert_eq!(detect_in(&vars), launch(Kind::Pmi, Some(8), Some(7)));
    }

    #[test]
    fn pmix_alone_has_no_size() {
        assert_eq!(
            detect_in(&[("PMIX_RANK", "1")]),
            launch(Kind::Pmix, None, Some(1))
        );
    }

    #[test]
    fn srun_gives_the_steps_task_count() {
        let vars = [
            ("SLURM_JOB_ID", "123"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_STEP_NUM_TASKS", "4"),
        ];
        assert_eq!(detect_in(&vars), launch(Kind::Srun, Some(4), Some(3)));
        let vars = [("SLURM_STEP_ID", "0"), ("SLURM_NTASKS", "2")];
        assert_eq!(detect_in(&vars), launch(Kind::Srun, Some(2), None));
        let vars = [("SLURM_STEP_ID", "0"), ("SLURM_PROCID", "0")];
        assert_eq!(detect_in(&vars), launch(Kind::Srun, None, Some(0)));
        // srun --mpi=pmix sets PMIx's variables too; srun's give the size.
        let vars = [
            ("SLURM_STEP_ID", "1"),
            ("SLURM_NTASKS", "2"),
            ("PMIX_RANK", "0"),
        ];
        assert_eq!(detect_in(&vars), launch(Kind::Srun, Some(2), None));
    }

    #[test]
    fn an_allocation_without_srun_is_no_launcher() {
        assert_eq!(detect_in(&[("SLURM_JOB_ID", "123")]), None);
        let vars = [
            ("SLURM_JOB_ID", "123"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_PROCID", "0"),
        ];
        assert_eq!(detect_in(&vars), None);
    }

    #[test]
    fn mpi_variables_win_over_the_allocations_srun_daemons() {
        // Open MPI's mpirun in an allocation: its daemon step has one task per node.
        let vars = [
            ("SLURM_STEP_ID", "0"),
            ("SLURM_NTASKS", "2"),
            ("OMPI_COMM_WORLD_SIZE", "16"),
            ("OMPI_COMM_WORLD_RANK", "5"),
        ];
        assert_eq!(detect_in(&vars), launch(Kind::OpenMpi, Some(16), Some(5)));
    }

    #[test]
    fn empty_or_garbled_values() {
        assert_eq!(detect_in(&[("OMPI_COMM_WORLD_SIZE", "")]), None);
        assert_eq!(
            detect_in(&[("PMI_SIZE", "four"), ("PMI_RANK", "0")]),
            launch(Kind::Pmi, None, Some(0))
        );
    }

    #[test]
    fn without_a_launcher_the_flag_or_threads() {
        assert_eq!(choose(None, None, true).unwrap(), Launcher::Threads);
        assert_eq!(choose(None, None, false).unwrap(), Launcher::Threads);
        let mpi = Some(Launcher::Mpi);
        assert_eq!(choose(mpi, None, true).unwrap(), Launcher::Mpi);
        // One process (mpirun -np 1, an srun shell) counts as no launcher.
        let one = launch(Kind::Srun, Some(1), None);
        assert_eq!(choose(None, one, false).unwrap(), Launcher::Threads);
        assert_eq!(
            choose(Some(Launcher::Threads), one, true).unwrap(),
            Launcher::Threads
        );
    }

    #[test]
    fn under_a_launcher_mpi_or_a_clear_refusal() {
        let four = launch(Kind::OpenMpi, Some(4), Some(0));
        assert_eq!(choose(None, four, true).unwrap(), Launcher::Mpi);
        assert_eq!(
            choose(Some(Launcher::Mpi), four, true).unwrap(),
            Launcher::Mpi
        );
        let e = choose(None, four, false).unwrap_err().to_string();
        assert!(
            e.contains("--features mpi") && e.contains("--ranks P"),
            "{e}"
        );
        assert!(e.contains("started 4 processes"), "{e}");
        let e = choose(Some(Launcher::Threads), four, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("Drop `--launcher threads`"), "{e}");
        let e = choose(
            Some(Launcher::Threads),
            launch(Kind::Pmix, None, Some(1)),
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("--features mpi"), "{e}");
    }

    #[test]
    fn single_process_commands_are_refused_under_several_processes() {
        assert!(refuse_copies("plan", None).is_ok());
        assert!(refuse_copies("plan", launch(Kind::Pmi, Some(1), Some(0))).is_ok());
        let e = refuse_copies("plan", launch(Kind::Srun, Some(2), Some(1)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`canopy plan`") && e.contains("bench attention"),
            "{e}"
        );
    }
}
