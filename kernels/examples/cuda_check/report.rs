//! The check's report: one row per comparison, relative errors.

// ------------------------------------------------------------------ report

pub(crate) struct Report {
    pub(crate) rows: Vec<(String, String, String, String, bool)>,
}

impl Report {
    pub(crate) fn new() -> Self {
        Self { rows: Vec::new() }
    }

    /// A toleranced comparison: max |got - want| / max |want|.
    pub(crate) fn close(&mut self, op: &str, case: &str, got: &[f32], want: &[f32], tol: f64) {
        let e = rel_err(got, want);
        self.push(op, case, format!("{e:.2e}"), format!("{tol:.0e}"), e <= tol);
    }

    pub(crate) fn close64(&mut self, op: &str, case: &str, got: &[f64], want: &[f64], tol: f64) {
        let e = rel_err64(got, want);
        self.push(op, case, format!("{e:.2e}"), format!("{tol:.0e}"), e <= tol);
    }

    /// Bit-exact comparison.
    pub(crate) fn exact_f32(&mut self, op: &str, case: &str, got: &[f32], want: &[f32]) {
        let ok = got.len() == want.len() && got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
        let e = if ok { "0 (bits)".to_string() } else { format!("{:.2e}", rel_err(got, want)) };
        self.push(op, case, e, "exact".into(), ok);
    }

    pub(crate) fn exact_f64(&mut self, op: &str, case: &str, got: &[f64], want: &[f64]) {
        let ok = got.len() == want.len() && got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
        let e = if ok { "0 (bits)".to_string() } else { format!("{:.2e}", rel_err64(got, want)) };
        self.push(op, case, e, "exact".into(), ok);
    }

    pub(crate) fn exact_i32(&mut self, op: &str, case: &str, got: &[i32], want: &[i32]) {
        let ok = got == want;
        let e = if ok {
            "0".to_string()
        } else {
            let bad = got.iter().zip(want).filter(|(a, b)| a != b).count();
            format!("{bad} differ")
        };
        self.push(op, case, e, "exact".into(), ok);
    }

    pub(crate) fn flag(&mut self, op: &str, case: &str, ok: bool, what: &str) {
        self.push(op, case, what.to_string(), "-".into(), ok);
    }

    pub(crate) fn push(&mut self, op: &str, case: &str, err: String, tol: String, ok: bool) {
        println!("| {op:<28} | {case:<44} | {err:>11} | {tol:>6} | {} |", if ok { "ok" } else { "FAIL" });
        self.rows.push((op.into(), case.into(), err, tol, ok));
    }

    pub(crate) fn failures(&self) -> usize {
        self.rows.iter().filter(|r| !r.4).count()
    }
}

pub(crate) fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let mut scale = 0.0f64;
    let mut diff = 0.0f64;
    for (&g, &w) in got.iter().zip(want) {
        if g == w {
            continue; // covers equal infinities
        }
        let d = (g as f64 - w as f64).abs();
        diff = if d.is_nan() { f64::INFINITY } else { diff.max(d) };
    }
    for &w in want {
        if w.is_finite() {
            scale = scale.max((w as f64).abs());
        }
    }
    if diff == 0.0 { 0.0 } else { diff / scale.max(1e-30) }
}

pub(crate) fn rel_err64(got: &[f64], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let mut scale = 0.0f64;
    let mut diff = 0.0f64;
    for (&g, &w) in got.iter().zip(want) {
        if g == w {
            continue;
        }
        let d = (g - w).abs();
        diff = if d.is_nan() { f64::INFINITY } else { diff.max(d) };
    }
    for &w in want {
        if w.is_finite() {
            scale = scale.max(w.abs());
        }
    }
    if diff == 0.0 { 0.0 } else { diff / scale.max(1e-300) }
}
