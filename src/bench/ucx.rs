//! `handoff bench transfer --transport ucx`: the engine's plans through the ucx
//! transport, beside `ucx_perftest`'s put bandwidth at the same message size
//! and beside the tcp transport, all measured in the same run.
//!
//! `ucx_perftest -t ucp_put_bw` puts one buffer over and over (it has no
//! option to walk a larger one: `-s` lists the pieces of one message, `-i`
//! spaces them, `-O` bounds the sends in flight), so at a size that fits the
//! caches it measures cache bandwidth, while a hand-off streams its bytes from
//! memory: 1.48 GB a pass on the flagship at 32K tokens. The fair peer is
//! therefore `ucx_perftest` at a message as large as a pass (up to
//! [`STREAMING_CAP`]), far beyond any cache: the same bytes from memory to
//! memory, in one put. It is printed first, with the ratio that counts.
//!
//! Beside it, labelled cache-resident, `ucx_perftest` at the hand-off's own
//! write sizes, counted by the transport over the passes (puts, and the
//! stores into peer regions UCX mapped here): the mean write (bytes over
//! writes) and the byte-weighted mean (sum of len^2 over sum of len, the size
//! of the write a typical byte travels in). `ucx_perftest` runs as two child
//! processes on this host (server, then client on 127.0.0.1), with UCX's own
//! `UCX_TLS` / `UCX_NET_DEVICES` set to the topology's `[transport.ucx]`, so
//! it uses the lanes the bench used.

use super::transfer::{BenchCmdOptions, TransferReport, bench_transfer_on, bench_transfer_with};
use crate::transport::auth::ClusterSecret;
use crate::transport::{TcpOptions, Transport, UcxOptions, UcxTransport};
use anyhow::Context;
use handoff_components::Topology;
use handoff_components::config::{TransportKind, UcxConfig};
use std::fmt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The largest message of the streaming `ucx_perftest`: its client and its
/// server each allocate about twice the message.
pub const STREAMING_CAP: u64 = 1 << 30;

/// `ucx_perftest -t ucp_put_bw` at one message size.
#[derive(Debug, Clone, PartialEq)]
pub struct Perftest {
    pub size: u64,
    pub iterations: u64,
    /// Its `-w`, where set (UCX's default is 10,000).
    pub warmup: Option<u64>,
    /// Its "overall" bandwidth, converted from MiB/s to 1e9 B/s.
    pub gb_per_s: f64,
    /// The client's `Final:` line as printed.
    pub line: String,
}

/// Why a measurement beside the ucx bench (`ucx_perftest`, the tcp bench) did not run.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NotMeasured {
    #[error("no put or store was issued")]
    NoPuts,
    #[error("a free port for ucx_perftest: {0}")]
    Port(Arc<std::io::Error>),
    #[error("starting ucx_perftest (Debian: apt-get install ucx-utils): {0}")]
    Start(Arc<std::io::Error>),
    #[error("running the ucx_perftest client: {0}")]
    Client(Arc<std::io::Error>),
    #[error("ucx_perftest did not finish {iterations} puts of {size} B within {after:?} (UCX's tcp lanes, for one, put a message this large at tens of MB/s)")]
    TooSlow { size: u64, iterations: u64, after: Duration },
    #[error("ucx_perftest client exited {status}: {stdout}{stderr}")]
    Exited { status: std::process::ExitStatus, stdout: String, stderr: String },
    #[error("no Final: line in ucx_perftest's output:\n{output}")]
    NoFinalLine { output: String },
    #[error("cannot read ucx_perftest's Final: line {line:?}")]
    BadFinalLine { line: String },
    /// The tcp bench's error, with its causes.
    #[error("{0:#}")]
    Tcp(Arc<anyhow::Error>),
}

/// What `bench transfer --transport ucx` measured.
#[derive(Debug, Clone)]
pub struct UcxTransferReport {
    pub ucx: TransferReport,
    pub tls: String,
    /// Puts, and stores into peer regions UCX mapped here, of one pass, as the
    /// transport counted them.
    pub puts_per_pass: u64,
    pub stores_per_pass: u64,
    /// Bytes over writes (puts and stores).
    pub mean_write: u64,
    /// Sum of len^2 over sum of len: the size of the write a typical byte travels in.
    pub weighted_write: u64,
    /// `ucx_perftest` at a pass's bytes (up to [`STREAMING_CAP`]): streaming
    /// from memory as the hand-off does; the fair peer.
    pub perftest_streaming: Result<Perftest, NotMeasured>,
    /// `ucx_perftest` at the mean write size (cache-resident).
    pub perftest: Result<Perftest, NotMeasured>,
    /// `ucx_perftest` at the byte-weighted write size (cache-resident).
    pub perftest_weighted: Result<Perftest, NotMeasured>,
    pub tcp: Result<TransferReport, NotMeasured>,
}

impl UcxTransferReport {
    /// The ucx transport's bandwidth over `ucx_perftest`'s streaming a pass-sized
    /// buffer: the comparison that counts.
    pub fn ratio_to_perftest_streaming(&self) -> Option<f64> {
        self.perftest_streaming.as_ref().ok().map(|p| self.ucx.gb_per_s / p.gb_per_s.max(1e-9))
    }

    /// The ucx transport's bandwidth over `ucx_perftest`'s at the mean write size.
    pub fn ratio_to_perftest(&self) -> Option<f64> {
        self.perftest.as_ref().ok().map(|p| self.ucx.gb_per_s / p.gb_per_s.max(1e-9))
    }

    /// The same at the byte-weighted put size.
    pub fn ratio_to_perftest_weighted(&self) -> Option<f64> {
        self.perftest_weighted.as_ref().ok().map(|p| self.ucx.gb_per_s / p.gb_per_s.max(1e-9))
    }
}

impl fmt::Display for UcxTransferReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.ucx)?;
        writeln!(
            f,
            "ucx lanes (UCX_TLS): {}; per pass {} puts and {} stores into peer regions UCX mapped here (ucp_rkey_ptr), mean write {} B, byte-weighted mean {} B",
            self.tls, self.puts_per_pass, self.stores_per_pass, self.mean_write, self.weighted_write
        )?;
        let runs = [
            ("streaming: one buffer as large as a pass, up to 1 GiB, from memory as the hand-off's bytes", &self.perftest_streaming),
            ("cache-resident: one buffer put over and over, at the mean write size", &self.perftest),
            ("cache-resident: one buffer put over and over, at the byte-weighted write size", &self.perftest_weighted),
        ];
        for (what, p) in runs {
            match p {
                Ok(p) => {
                    let w = p.warmup.map_or(String::new(), |w| format!(" -w {w}"));
                    writeln!(f, "ucx_perftest -t ucp_put_bw -s {} -n {}{w} ({what}; same run, same lanes): {:.2} GB/s", p.size, p.iterations, p.gb_per_s)?;
                    writeln!(f, "  {}", p.line)?;
                }
                Err(e) => writeln!(f, "ucx_perftest ({what}): not measured: {e}")?,
            }
        }
        match &self.tcp {
            Ok(t) => writeln!(
                f,
                "tcp transport (same run, same plans): {:.2} GB/s, byte-exact: {}",
                t.gb_per_s,
                if t.verified.is_some() { "yes" } else { "not checked" }
            )?,
            Err(e) => writeln!(f, "tcp transport: not measured: {e}")?,
        }
        if let Ok(t) = &self.tcp {
            writeln!(f, "ratio to tcp: {:.3}", self.ucx.gb_per_s / t.gb_per_s.max(1e-9))?;
        }
        let show = |r: Option<f64>| r.map_or("not measured".to_string(), |r| format!("{r:.3}"));
        writeln!(f, "ratio to ucx_perftest streaming a pass-sized buffer (the fair peer): {}", show(self.ratio_to_perftest_streaming()))?;
        writeln!(f, "ratio to ucx_perftest cache-resident at the byte-weighted write size: {}", show(self.ratio_to_perftest_weighted()))?;
        write!(f, "ratio to ucx_perftest cache-resident at the mean write size: {}", show(self.ratio_to_perftest()))
    }
}

/// Runs the ucx bench, `ucx_perftest` and the tcp bench, in that order, in one run.
/// `ucx` overrides the topology's `[transport.ucx]` where it names a setting.
pub fn bench_transfer_ucx(config_path: &str, tokens: u64, requests: u32, ucx: &UcxConfig, o: &BenchCmdOptions) -> anyhow::Result<UcxTransferReport> {
    let topo = Topology::load(config_path).with_context(|| format!("loading {config_path}"))?;
    let base = &topo.config.transport.ucx;
    let settings = UcxConfig { tls: ucx.tls.clone().or_else(|| base.tls.clone()), net_devices: ucx.net_devices.clone().or_else(|| base.net_devices.clone()) };
    let open = || {
        UcxTransport::open(UcxOptions {
            ucx: settings.clone(),
            notify: TcpOptions { secret: ClusterSecret::process(), ..TcpOptions::default() },
            ..UcxOptions::default()
        })
    };
    let producer = Arc::new(open().context("opening the ucx transport")?);
    let consumer = Arc::new(open().context("opening the ucx transport")?);
    let before = (producer.put_stats(), producer.stored_stats());
    let report = bench_transfer_on(config_path, &topo, producer.clone() as Arc<dyn Transport>, consumer.clone() as Arc<dyn Transport>, tokens, requests, o)?;
    let after = (producer.put_stats(), producer.stored_stats());
    let weighted_write = producer.weighted_write_size();
    drop((producer, consumer));
    let passes = (report.passes + report.warmup).max(1) as u64;
    let (puts, stores) = (after.0.0 - before.0.0, after.1.0 - before.1.0);
    let bytes = (after.0.1 - before.0.1) + (after.1.1 - before.1.1);
    let mean_write = bytes.checked_div(puts + stores).unwrap_or(0);
    // The perftest runs go first: the tcp bench leaves no UCX process behind,
    // and theirs are the figures the ratio is taken to.
    let streaming = report.bytes_per_pass.min(STREAMING_CAP);
    let perftest_streaming = if streaming == 0 { Err(NotMeasured::NoPuts) } else { ucx_perftest_streaming(streaming, &settings) };
    let perf = |size: u64| if size == 0 { Err(NotMeasured::NoPuts) } else { ucx_perftest_put_bw(size, &settings) };
    let (perftest, perftest_weighted) = (perf(mean_write), perf(weighted_write));
    let tcp = bench_transfer_with(config_path, TransportKind::Tcp, tokens, requests, o).map_err(|e| NotMeasured::Tcp(Arc::new(e)));
    let tls = settings.tls.clone().unwrap_or_else(|| "UCX's default".into());
    Ok(UcxTransferReport {
        ucx: report,
        tls,
        puts_per_pass: puts / passes,
        stores_per_pass: stores / passes,
        mean_write,
        weighted_write,
        perftest_streaming,
        perftest,
        perftest_weighted,
        tcp,
    })
}

/// `ucx_perftest -t ucp_put_bw -s SIZE` between a server and a client process on
/// this host, with the lanes of `ucx`; about 2 GB moved.
pub fn ucx_perftest_put_bw(size: u64, ucx: &UcxConfig) -> Result<Perftest, NotMeasured> {
    ucx_perftest(size, (2_000_000_000 / size.max(1)).clamp(200, 200_000), None, None, ucx)
}

/// How long the streaming `ucx_perftest` may take: on shared memory it needs
/// a few seconds (most of them allocating), while UCX's tcp lanes put a
/// 1 GiB message at tens of MB/s, minutes for the run.
pub const STREAMING_LIMIT: Duration = Duration::from_secs(30);

/// `ucx_perftest -t ucp_put_bw` at a message too large for any cache: about
/// 4 GB moved (at least 3 puts), after one warm-up put instead of UCX's 10,000;
/// given up after [`STREAMING_LIMIT`].
pub fn ucx_perftest_streaming(size: u64, ucx: &UcxConfig) -> Result<Perftest, NotMeasured> {
    ucx_perftest(size, (4_000_000_000 / size.max(1)).clamp(3, 1000), Some(1), Some(STREAMING_LIMIT), ucx)
}

fn ucx_perftest(size: u64, iterations: u64, warmup: Option<u64>, limit: Option<Duration>, ucx: &UcxConfig) -> Result<Perftest, NotMeasured> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).map_err(|e| NotMeasured::Port(Arc::new(e)))?;
    let command = |extra: &[String]| {
        let mut c = Command::new("ucx_perftest");
        c.args(["-p", &port.to_string()]).args(extra).stdin(Stdio::null());
        if let Some(t) = &ucx.tls {
            c.env("UCX_TLS", t);
        }
        if let Some(d) = &ucx.net_devices {
            c.env("UCX_NET_DEVICES", d);
        }
        c
    };
    let mut server = command(&[]).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().map_err(|e| NotMeasured::Start(Arc::new(e)))?;
    let mut client_args: Vec<String> =
        ["127.0.0.1", "-t", "ucp_put_bw", "-s", &size.to_string(), "-n", &iterations.to_string()].iter().map(|s| s.to_string()).collect();
    if let Some(w) = warmup {
        client_args.extend(["-w".to_string(), w.to_string()]);
    }
    // The server listens once it started; retry the client until it connects.
    let deadline = Instant::now() + Duration::from_secs(10);
    let out = loop {
        std::thread::sleep(Duration::from_millis(200));
        let out = run_client(command(&client_args), limit);
        let out = match out {
            Ok(Some(out)) => out,
            Ok(None) => {
                let _ = server.kill();
                let _ = server.wait();
                return Err(NotMeasured::TooSlow { size, iterations, after: limit.unwrap_or_default() });
            }
            Err(e) => return Err(NotMeasured::Client(Arc::new(e))),
        };
        if out.status.success() || Instant::now() >= deadline {
            break out;
        }
    };
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(NotMeasured::Exited {
            status: out.status,
            stdout: text.trim().to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    let line = text.lines().find(|l| l.trim_start().starts_with("Final:")).ok_or_else(|| NotMeasured::NoFinalLine { output: text.to_string() })?;
    let mib_s = parse_final(line).ok_or_else(|| NotMeasured::BadFinalLine { line: line.to_string() })?;
    Ok(Perftest { size, iterations, warmup, gb_per_s: mib_s * 1_048_576.0 / 1e9, line: line.trim().to_string() })
}

/// Runs the client to its end, or (`None`) kills it once `limit` passed. Its
/// output is read on threads, so a full pipe never stalls it.
fn run_client(mut command: Command, limit: Option<Duration>) -> std::io::Result<Option<std::process::Output>> {
    let Some(limit) = limit else { return command.output().map(Some) };
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut v);
            }
            v
        })
    };
    let out = drain(child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>));
    let err = drain(child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>));
    let end = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (stdout, stderr) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
    Ok(status.map(|status| std::process::Output { status, stdout, stderr }))
}

/// The overall bandwidth (MiB/s: UCX's "MB/s" is 2^20 bytes) of a
/// `Final: iters p50 avg overall bw_avg bw_overall rate_avg rate_overall` line.
pub fn parse_final(line: &str) -> Option<f64> {
    let nums: Vec<f64> = line.split_whitespace().skip(1).filter_map(|w| w.parse().ok()).collect();
    (nums.len() >= 7).then(|| nums[5])
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_final_line_gives_the_overall_bandwidth() {
        let l = "Final:                   300     93.136   262.053   262.053    15264.09   15264.09        3816        3816";
        assert_eq!(super::parse_final(l), Some(15264.09));
        assert_eq!(super::parse_final("Final: 1 2"), None);
    }
}
