//! A CUDA MPS server of `handoff up`'s own (`[device] mps = true`).
//!
//! The roles of a cluster on one GPU are separate processes, so without MPS
//! their contexts take turns on the device in time slices: a prefill pass and
//! a decode step never run at once. Under an MPS server their kernels run side
//! by side. `up` starts a control daemon with pipe and log directories of its
//! own (so it neither needs nor touches a system-wide one), points every role
//! at it, and asks it to quit when the cluster stops. No device setting
//! changes; the compute mode stays as it is.

use anyhow::Context;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The control program (CUDA's driver utilities put it on the PATH).
const CONTROL: &str = "nvidia-cuda-mps-control";
/// The variables that point a CUDA client (and the control program) at a server.
pub const PIPE_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";
pub const LOG_ENV: &str = "CUDA_MPS_LOG_DIRECTORY";

/// A running MPS control daemon; dropping it asks the daemon to quit and
/// removes its directories.
#[derive(Debug)]
pub struct MpsServer {
    dir: PathBuf,
}

impl MpsServer {
    /// Starts a control daemon in a directory of its own named after `tag`.
    pub fn start(tag: &str) -> anyhow::Result<MpsServer> {
        let dir = std::env::temp_dir().join(format!("handoff-mps-{tag}"));
        let server = MpsServer { dir };
        for d in [server.pipe_dir(), server.log_dir()] {
            std::fs::create_dir_all(&d).with_context(|| format!("[device] mps = true: create {}", d.display()))?;
        }
        let status = Command::new(CONTROL)
            .arg("-d")
            .envs(server.envs())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .with_context(|| format!("[device] mps = true: start {CONTROL} -d (is it on the PATH?)"))?;
        anyhow::ensure!(status.success(), "[device] mps = true: {CONTROL} -d exited with {status} (see {})", server.log_dir().display());
        tracing::info!(dir = %server.dir.display(), "roles run under an MPS server of this cluster");
        Ok(server)
    }

    /// The variables every role gets.
    pub fn envs(&self) -> Vec<(String, String)> {
        vec![(PIPE_ENV.to_string(), self.pipe_dir().to_string_lossy().to_string()), (LOG_ENV.to_string(), self.log_dir().to_string_lossy().to_string())]
    }

    fn pipe_dir(&self) -> PathBuf {
        self.dir.join("pipe")
    }

    fn log_dir(&self) -> PathBuf {
        self.dir.join("log")
    }
}

impl Drop for MpsServer {
    fn drop(&mut self) {
        let quit = Command::new(CONTROL).envs(self.envs()).stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::null()).spawn();
        if let Ok(mut c) = quit {
            if let Some(mut stdin) = c.stdin.take() {
                use std::io::Write;
                let _ = stdin.write_all(b"quit\n");
            }
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
