//! `GET /metrics`: the Prometheus text of the proxy's counts and of every role's.

use super::state::{Peer, PeerState, Proxy, role_label};
use crate::base::lock;
use crate::roles::prom::{self, SYSTEM_BUCKETS_S};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub(super) async fn metrics(State(p): State<Arc<Proxy>>) -> Response {
    let mut out = String::new();
    {
        let m = lock(&p.metrics);
        out += "# HELP handoff_requests_total Generation requests by outcome (cancelled: the client went away).\n# TYPE handoff_requests_total counter\n";
        for o in ["ok", "rejected", "overloaded", "unavailable", "failed", "cancelled"] {
            out += &format!("handoff_requests_total{{outcome=\"{o}\"}} {}\n", m.outcomes.get(o).copied().unwrap_or(0));
        }
        out += "# HELP handoff_refusals_total Requests refused before generation, by reason.\n# TYPE handoff_refusals_total counter\n";
        for (r, n) in &m.refusals {
            out += &format!("handoff_refusals_total{{reason=\"{r}\"}} {n}\n");
        }
        prom::family(&mut out, "handoff_request_failures_total", "counter", "Requests failed after admission, by the phase and the role that failed them.");
        for ((phase, role), n) in &m.failures {
            out += &format!("handoff_request_failures_total{{phase=\"{phase}\",role=\"{}\"}} {n}\n", prom::escape(role));
        }
        prom::family(
            &mut out,
            "handoff_request_retries_total",
            "counter",
            "Requests sent again once a role they were in had died and was back (at most once per request and fault), by the phase they were in and the role that died.",
        );
        for ((phase, role), n) in &m.retries {
            out += &format!("handoff_request_retries_total{{phase=\"{phase}\",role=\"{}\"}} {n}\n", prom::escape(role));
        }
        prom::family(
            &mut out,
            "handoff_request_timeouts_total",
            "counter",
            "Requests failed because a phase ran out of time (its deadline, or a peer found stopped), by phase.",
        );
        for ph in ["admission", "compute", "transfer", "decode"] {
            out += &format!("handoff_request_timeouts_total{{phase=\"{ph}\"}} {}\n", m.timeouts.get(ph).copied().unwrap_or(0));
        }
        prom::family(&mut out, "handoff_time_to_first_token_seconds", "histogram", "From the request's arrival to its first token, per choice.");
        prom::write_histogram(&mut out, "handoff_time_to_first_token_seconds", "", &m.ttft);
        prom::family(&mut out, "handoff_inter_token_latency_seconds", "histogram", "Between two tokens of one choice.");
        prom::write_histogram(&mut out, "handoff_inter_token_latency_seconds", "", &m.itl);
        prom::family(&mut out, "handoff_e2e_request_latency_seconds", "histogram", "From the request's arrival to its last token, per completed choice.");
        prom::write_histogram(&mut out, "handoff_e2e_request_latency_seconds", "", &m.e2e);
        prom::family(
            &mut out,
            "handoff_phase_seconds",
            "histogram",
            "Seconds per phase of each completed choice: queue (waiting for a place), handoff (admission to the last write-done), decode.",
        );
        for (ph, h) in &m.phases {
            prom::write_histogram(&mut out, "handoff_phase_seconds", &format!("phase=\"{ph}\""), h);
        }
        prom::family(
            &mut out,
            "handoff_handoff_tail_seconds",
            "histogram",
            "The hand-off tail of each completed choice: the longest of its prefill stages' times from the stage's last layer computed to its write-done report.",
        );
        prom::write_histogram(&mut out, "handoff_handoff_tail_seconds", "", &m.tail);
        out += "# HELP handoff_handoff_bytes_total Bytes written from prefill into decode regions.\n# TYPE handoff_handoff_bytes_total counter\n";
        out += &format!("handoff_handoff_bytes_total {}\n", m.bytes);
        out += "# HELP handoff_generated_tokens_total Tokens generated.\n# TYPE handoff_generated_tokens_total counter\n";
        out += &format!("handoff_generated_tokens_total {}\n", m.tokens);
        out += "# HELP handoff_connections_closed_total Connections a listener refused past serve.max_connections (max_connections) or closed because a request's headers did not arrive within serve.header_timeout_s (header_timeout).\n# TYPE handoff_connections_closed_total counter\n";
        for l in ["public", "control"] {
            for r in ["max_connections", "header_timeout"] {
                out += &format!("handoff_connections_closed_total{{listener=\"{l}\",reason=\"{r}\"}} {}\n", m.closed.get(&(l, r)).copied().unwrap_or(0));
            }
        }
    }
    out += "# HELP handoff_open_connections Connections the public listener holds now.\n# TYPE handoff_open_connections gauge\n";
    out += &format!("handoff_open_connections {}\n", (p.topo.config.serve.max_connections as usize).saturating_sub(p.public_slots.available_permits()));
    let (slots, downs) = {
        let r = lock(&p.roles);
        (r.slots.clone(), r.downs.clone())
    };
    out += "# HELP handoff_role_up Whether the role is registered and answering (1) or not (0).\n# TYPE handoff_role_up gauge\n";
    for (i, s) in slots.iter().enumerate() {
        out += &format!("handoff_role_up{{role=\"{}\"}} {}\n", role_label(i), u8::from(s.as_ref().is_some_and(|s| s.state == PeerState::Up)));
    }
    out += "# HELP handoff_role_restarts_total Times `up` restarted the role.\n# TYPE handoff_role_restarts_total counter\n";
    out += &format!("handoff_role_restarts_total{{role=\"proxy\"}} {}\n", p.restarts);
    for (i, s) in slots.iter().enumerate() {
        out += &format!("handoff_role_restarts_total{{role=\"{}\"}} {}\n", role_label(i), s.as_ref().map_or(0, |s| s.reg.restarts));
    }
    out += "# HELP handoff_role_down_total Times the proxy saw the role die or stop answering.\n# TYPE handoff_role_down_total counter\n";
    for (i, n) in downs.iter().enumerate() {
        out += &format!("handoff_role_down_total{{role=\"{}\"}} {n}\n", role_label(i));
    }
    // What every role's engine holds now (from its last heartbeat): these return to
    // their baseline once every request has left. A role that is down holds
    // nothing (its process is gone, or its requests were failed and are freed when
    // it resumes), so its gauges read 0 until it registers again.
    let live: Vec<(String, &Peer)> = slots.iter().enumerate().filter_map(|(i, s)| s.as_ref().map(|s| (role_label(i), s))).collect();
    let zero = crate::engine::Counts::default();
    let counts = |peer: &Peer| if peer.state == PeerState::Up { peer.reg.counts.clone() } else { zero.clone() };
    for (name, help, get) in [
        ("handoff_engine_entities", "Entities in the role's World.", (|c: &crate::engine::Counts| c.entities as u64) as fn(&crate::engine::Counts) -> u64),
        ("handoff_engine_requests", "Requests the role's engine holds.", |c| c.requests as u64),
        ("handoff_engine_plans", "Plans the role's engine holds.", |c| c.plans as u64),
        ("handoff_producer_entries", "Live producer entries of the role's stage.", |c| c.producer_entries.iter().map(|&(_, n)| n as u64).sum()),
        ("handoff_engine_free_blocks", "Free blocks over the role's ranks.", |c| c.free_blocks),
        ("handoff_engine_free_slots", "Free slots over the role's ranks.", |c| c.free_slots),
        ("handoff_sampling_entries", "Requests that sample, in the role's engine (0 once every request has left).", |c| c.sampling as u64),
        ("handoff_prefill_settled", "Requests a prefill stage settled before their job came (each forgotten 120 s after).", |c| c.settled as u64),
    ] {
        out += &format!("# HELP {name} {help}\n# TYPE {name} gauge\n");
        for (role, peer) in &live {
            out += &format!("{name}{{role=\"{role}\"}} {}\n", get(&counts(peer)));
        }
    }
    // Every role's refusals, from its last heartbeat (a counter of that process:
    // it restarts from 0 with the process, as Prometheus counters may).
    out += "# HELP handoff_unauthenticated_connections_total Connections (shm: notification datagrams) refused for not proving the cluster secret, by role and listener.\n# TYPE handoff_unauthenticated_connections_total counter\n";
    out += &format!("handoff_unauthenticated_connections_total{{role=\"proxy\",listener=\"register\"}} {}\n", lock(&p.metrics).unauthenticated_register);
    out += "# HELP handoff_replayed_registrations_total Registrations and heartbeats refused as replays (a timestamp not after the role's last accepted one); also in the count above.\n# TYPE handoff_replayed_registrations_total counter\n";
    out += &format!("handoff_replayed_registrations_total {}\n", lock(&p.metrics).replayed_register);
    for (i, s) in slots.iter().enumerate() {
        for (listener, n) in s.as_ref().map(|s| s.reg.unauthenticated.clone()).unwrap_or_default() {
            out += &format!("handoff_unauthenticated_connections_total{{role=\"{}\",listener=\"{listener}\"}} {n}\n", role_label(i));
        }
    }
    out += "# HELP handoff_refused_frames_total Messages refused after a handshake (control lines, tcp frames, shm datagrams whose MAC does not hold for their place: altered, replayed, reordered, from another connection), by role and kind; each closes its connection (shm: the datagram is dropped).\n# TYPE handoff_refused_frames_total counter\n";
    out += &format!("handoff_refused_frames_total{{role=\"proxy\",kind=\"control\"}} {}\n", lock(&p.metrics).refused_control_messages);
    for (i, s) in slots.iter().enumerate() {
        for (kind, n) in s.as_ref().map(|s| s.reg.refused_frames.clone()).unwrap_or_default() {
            out += &format!("handoff_refused_frames_total{{role=\"{}\",kind=\"{kind}\"}} {n}\n", role_label(i));
        }
    }
    out += "# HELP handoff_resident_memory_bytes Resident memory of each role process.\n# TYPE handoff_resident_memory_bytes gauge\n";
    out += &format!("handoff_resident_memory_bytes{{role=\"proxy\"}} {}\n", crate::roles::host::rss_bytes());
    for (role, peer) in &live {
        let rss = if peer.state == PeerState::Up { peer.reg.rss_bytes } else { 0 };
        out += &format!("handoff_resident_memory_bytes{{role=\"{role}\"}} {rss}\n");
    }
    // Every role's engine timings since its process started (a restarted role
    // starts again from zero, as a Prometheus counter does after a restart).
    prom::family(
        &mut out,
        "handoff_engine_system_seconds",
        "histogram",
        "Run time of each system of the role's engine schedule, per run (the spans `plan --timings` reads).",
    );
    for (role, peer) in &live {
        for t in &peer.reg.timings {
            let labels = format!("role=\"{role}\",phase=\"{}\",system=\"{}\"", prom::escape(&t.phase), prom::escape(&t.system));
            prom::histogram_series(&mut out, "handoff_engine_system_seconds", &labels, SYSTEM_BUCKETS_S, &t.cumulative, t.count, t.sum_s);
        }
    }
    prom::family(&mut out, "handoff_engine_phase_seconds", "histogram", "Run time of the systems of each phase of the role's engine schedule, per system run.");
    for (role, peer) in &live {
        for (phase, cumulative, count, sum) in prom::per_phase(&peer.reg.timings) {
            prom::histogram_series(
                &mut out,
                "handoff_engine_phase_seconds",
                &format!("role=\"{role}\",phase=\"{phase}\""),
                SYSTEM_BUCKETS_S,
                &cumulative,
                count,
                sum,
            );
        }
    }
    let decode_live = slots[0].as_ref().filter(|s| s.state == PeerState::Up).map_or(0, |d| d.reg.counts.requests);
    out += "# HELP handoff_live_requests Requests held by decode's engine (0 while decode is down).\n# TYPE handoff_live_requests gauge\n";
    out += &format!("handoff_live_requests {decode_live}\n");
    out += "# HELP handoff_queued_requests Requests waiting for a place.\n# TYPE handoff_queued_requests gauge\n";
    out += &format!("handoff_queued_requests {}\n", p.queued.load(Ordering::SeqCst));
    out += "# HELP handoff_inflight_requests Generation requests being served.\n# TYPE handoff_inflight_requests gauge\n";
    out += &format!("handoff_inflight_requests {}\n", p.inflight.load(Ordering::SeqCst));
    ([("content-type", "text/plain; version=0.0.4")], out).into_response()
}
