//! Graphs of the launch lists (one a bucket) and the `DecodeStep` the step
//! runs as.

use super::*;

impl<D: Driver> GpuStep<D> {
    /// Launches the bucket's list on the stream, one by one.
    pub(super) fn launch_list(&self, bp: usize) -> Result<()> {
        let list =
            self.lists.get(&bp).ok_or_else(|| KernelError::InvalidShape { op: "decode_step launch", reason: format!("no launch list for bucket {bp}") })?;
        launch_all(&self.drv, list, self.dependent)
    }

    /// The bucket's graph, captured on first use; None when capture failed
    /// (said once; the step then launches the list).
    pub(super) fn graph(&mut self, bp: usize) -> Option<&D::Graph> {
        if self.graph_failure.is_some() {
            return None;
        }
        if !self.graphs.contains_key(&bp) {
            match self.capture(bp) {
                Ok(g) => {
                    self.graphs.insert(bp, g);
                }
                Err(e) => {
                    tracing::warn!("decode step: {} graph capture of bucket {bp} failed ({e}); launching the step's kernels one by one from now on", D::LABEL);
                    self.graph_failure = Some(e.to_string());
                    return None;
                }
            }
        }
        self.graphs.get(&bp)
    }

    pub(super) fn capture(&self, bp: usize) -> Result<D::Graph> {
        let op = "decode_step capture";
        self.drv.begin_capture().map_err(dev(op))?;
        let launched = self.launch_list(bp);
        let ended = self.drv.end_capture();
        launched?;
        let g = ended.map_err(dev(op))?.ok_or_else(|| KernelError::Device { op, message: "the capture produced no graph".into() })?;
        self.drv.prepare_graph(&g).map_err(dev(op))?;
        Ok(g)
    }
}

impl<D: Driver> DecodeStep for GpuStep<D> {
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
        self.drv.bind().map_err(dev(op))?;
        // SAFETY: tick_dev holds lay.len() i32s.
        unsafe { self.drv.upload(self.tick_dev, &self.tick_host) }.map_err(dev(op))?;
        // `graph` captures the bucket on first use (None: capture failed);
        // the graph is then looked up again so that the driver can be
        // borrowed beside it.
        let replayed = self.graphs_on && self.graph(bp).is_some();
        match self.graphs.get(&bp) {
            Some(g) if replayed => self.drv.replay(g).map_err(dev("decode_step graph launch"))?,
            _ => self.launch_list(bp)?,
        }
        let n = batch.len();
        // SAFETY: ids_dev holds at least bmax i32s, logits_dev bmax * vocab floats.
        unsafe { self.drv.download(&mut self.ids_host[..n], self.ids_dev) }.map_err(dev(op))?;
        if let Some(out) = logits {
            out.resize(n * self.vocab, 0.0);
            unsafe { self.drv.download(&mut out[..], self.logits_dev) }.map_err(dev(op))?;
        }
        self.drv.synchronize().map_err(dev(op))?;
        Ok(self.ids_host[..n].iter().map(|&x| x.max(0) as u32).collect())
    }

    fn describe(&self) -> String {
        let per = self.lists.get(self.buckets.last().unwrap_or(&1)).map_or(0, |l| l.len());
        format!(
            "fused decode step: {per} launches a step, buckets {:?}, {} graphs {}{}, dependent launches {}, {:.1} MiB of weights, {:.1} MiB in all",
            self.buckets,
            D::LABEL,
            if self.graphs_on { "on" } else { "off" },
            self.graph_failure.as_ref().map_or(String::new(), |e| format!(" (capture failed: {e})")),
            if self.dependent { "on" } else { "off" },
            self.weight_bytes as f64 / (1 << 20) as f64,
            self._arena.bytes as f64 / (1 << 20) as f64
        )
    }

    fn set_graphs(&mut self, on: bool) {
        self.graphs_on = on;
    }

    fn set_dependent_launch(&mut self, on: bool) {
        let on = on && self.drv.dependent_launch();
        if on != self.dependent {
            // A graph holds the launches as captured.
            self.graphs.clear();
            self.dependent = on;
        }
    }

    fn launches(&self) -> usize {
        self.lists.get(self.buckets.last().unwrap_or(&1)).map_or(0, |l| l.len())
    }

    fn profile(&mut self, batch: &[StepRequest<'_>]) -> Result<Vec<KernelTime>> {
        let op = "decode_step profile";
        let bp = bucket_of(&self.buckets, batch.len().max(1))
            .ok_or_else(|| KernelError::InvalidShape { op, reason: format!("a batch of {} requests", batch.len()) })?;
        self.lay.fill(batch, self.bounds, &mut self.tick_host)?;
        self.drv.bind().map_err(dev(op))?;
        // SAFETY: tick_dev holds lay.len() i32s.
        unsafe { self.drv.upload(self.tick_dev, &self.tick_host) }.map_err(dev(op))?;
        let list = self.lists.get(&bp).ok_or_else(|| KernelError::InvalidShape { op, reason: format!("no bucket {bp}") })?;
        let mut events = Vec::with_capacity(list.len() + 1);
        events.push(self.drv.record_event().map_err(dev(op))?);
        for l in list {
            // Plain launches: an event between two kernels is no kernel to depend on.
            launch_all(&self.drv, std::slice::from_ref(l), false)?;
            events.push(self.drv.record_event().map_err(dev(op))?);
        }
        self.drv.synchronize().map_err(dev(op))?;
        let mut out: Vec<KernelTime> = Vec::new();
        for (i, l) in list.iter().enumerate() {
            let us = self.drv.elapsed_ms(&events[i], &events[i + 1]).map_err(dev(op))? as f64 * 1e3;
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
