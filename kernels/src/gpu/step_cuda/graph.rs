//! CUDA graphs of the launch lists (one a bucket) and the `DecodeStep` the
//! step runs as.

use super::*;

impl CudaStep {
    /// Launches the bucket's list on the stream, one by one.
    pub(super) fn launch_list(&self, bp: usize) -> Result<()> {
        let list =
            self.lists.get(&bp).ok_or_else(|| KernelError::InvalidShape { op: "decode_step launch", reason: format!("no launch list for bucket {bp}") })?;
        launch_all(&self.ctx, &self.stream, list)
    }

    /// The bucket's graph, captured on first use; None when capture failed
    /// (said once; the step then launches the list).
    pub(super) fn graph(&mut self, bp: usize) -> Option<&Graph> {
        if self.graph_failure.is_some() {
            return None;
        }
        if !self.graphs.contains_key(&bp) {
            match self.capture(bp) {
                Ok(g) => {
                    self.graphs.insert(bp, g);
                }
                Err(e) => {
                    tracing::warn!("decode step: CUDA graph capture of bucket {bp} failed ({e}); launching the step's kernels one by one from now on");
                    self.graph_failure = Some(e.to_string());
                    return None;
                }
            }
        }
        self.graphs.get(&bp)
    }

    pub(super) fn capture(&self, bp: usize) -> Result<Graph> {
        let op = "decode_step capture";
        self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(dev(op))?;
        let launched = self.launch_list(bp);
        let ended = self.stream.end_capture(CUgraphInstantiate_flags(0));
        launched?;
        let g = ended.map_err(dev(op))?.ok_or_else(|| KernelError::Device { op, message: "the capture produced no graph".into() })?;
        g.upload().map_err(dev(op))?;
        Ok(Graph(g))
    }
}

impl DecodeStep for CudaStep {
    fn run(&mut self, batch: &[StepRequest<'_>], logits: Option<&mut Vec<f32>>) -> Result<Vec<u32>> {
        let op = "decode_step";
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let bp = bucket_of(&self.buckets, batch.len()).ok_or_else(|| KernelError::InvalidShape {
            op,
            reason: format!("a batch of {} requests, more than the step's largest bucket {}", batch.len(), self.buckets.last().copied().unwrap_or(0)),
        })?;
        self.lay.fill(batch, self.bounds, &mut self.tick_host)?;
        self.ctx.bind_to_thread().map_err(dev(op))?;
        let s = self.stream.cu_stream();
        // SAFETY: tick_dev holds lay.len() i32s.
        unsafe { result::memcpy_htod_async(self.tick_dev, &self.tick_host, s) }.map_err(dev(op))?;
        let replayed = if self.graphs_on {
            match self.graph(bp) {
                Some(g) => {
                    g.0.launch().map_err(dev("decode_step graph launch"))?;
                    true
                }
                None => false,
            }
        } else {
            false
        };
        if !replayed {
            self.launch_list(bp)?;
        }
        let n = batch.len();
        // SAFETY: ids_dev holds at least bmax i32s, logits_dev bmax * vocab floats.
        unsafe { result::memcpy_dtoh_async(&mut self.ids_host[..n], self.ids_dev, s) }.map_err(dev(op))?;
        if let Some(out) = logits {
            out.resize(n * self.vocab, 0.0);
            unsafe { result::memcpy_dtoh_async(&mut out[..], self.logits_dev, s) }.map_err(dev(op))?;
        }
        self.stream.synchronize().map_err(dev(op))?;
        Ok(self.ids_host[..n].iter().map(|&x| x.max(0) as u32).collect())
    }

    fn describe(&self) -> String {
        let per = self.lists.get(self.buckets.last().unwrap_or(&1)).map_or(0, |l| l.len());
        format!(
            "fused decode step: {per} launches a step, buckets {:?}, CUDA graphs {}{}, {:.1} MiB of weights, {:.1} MiB in all",
            self.buckets,
            if self.graphs_on { "on" } else { "off" },
            self.graph_failure.as_ref().map_or(String::new(), |e| format!(" (capture failed: {e})")),
            self.weight_bytes as f64 / (1 << 20) as f64,
            self._arena.bytes as f64 / (1 << 20) as f64
        )
    }

    fn set_graphs(&mut self, on: bool) {
        self.graphs_on = on;
    }

    fn launches(&self) -> usize {
        self.lists.get(self.buckets.last().unwrap_or(&1)).map_or(0, |l| l.len())
    }

    fn profile(&mut self, batch: &[StepRequest<'_>]) -> Result<Vec<KernelTime>> {
        let op = "decode_step profile";
        let bp = bucket_of(&self.buckets, batch.len().max(1))
            .ok_or_else(|| KernelError::InvalidShape { op, reason: format!("a batch of {} requests", batch.len()) })?;
        self.lay.fill(batch, self.bounds, &mut self.tick_host)?;
        self.ctx.bind_to_thread().map_err(dev(op))?;
        // SAFETY: tick_dev holds lay.len() i32s.
        unsafe { result::memcpy_htod_async(self.tick_dev, &self.tick_host, self.stream.cu_stream()) }.map_err(dev(op))?;
        let list = self.lists.get(&bp).ok_or_else(|| KernelError::InvalidShape { op, reason: format!("no bucket {bp}") })?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut events = Vec::with_capacity(list.len() + 1);
        events.push(self.stream.record_event(flags).map_err(dev(op))?);
        for l in list {
            launch_all(&self.ctx, &self.stream, std::slice::from_ref(l))?;
            events.push(self.stream.record_event(flags).map_err(dev(op))?);
        }
        self.stream.synchronize().map_err(dev(op))?;
        let mut out: Vec<KernelTime> = Vec::new();
        for (i, l) in list.iter().enumerate() {
            let us = events[i].elapsed_ms(&events[i + 1]).map_err(dev(op))? as f64 * 1e3;
            match out.iter_mut().find(|k| k.name == l.name) {
                Some(k) => {
                    k.launches += 1;
                    k.us += us;
                }
                None => out.push(KernelTime { name: l.name, launches: 1, us }),
            }
        }
        out.sort_by(|a, b| b.us.total_cmp(&a.us));
        Ok(out)
    }
}
