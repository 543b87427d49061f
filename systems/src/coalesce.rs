//! Coalescing: adjacent copies merge into one, and copies that repeat at a fixed
//! distance merge into one strided descriptor. Merging never changes the set of
//! (src, dst, len) pieces a plan copies.

use handoff_components::plan::Descriptor;

/// Accumulates descriptors in emission order, merging each into the previous one
/// where it continues it.
#[derive(Debug, Default)]
pub struct Coalescer {
    out: Vec<Descriptor>,
}

impl Coalescer {
    pub fn push(&mut self, d: Descriptor) {
        if d.count == 0 || d.len == 0 {
            return;
        }
        let d = normalize(d);
        if let Some(last) = self.out.last_mut()
            && let Some(m) = merge(last, &d)
        {
            *last = normalize(m);
            return;
        }
        self.out.push(d);
    }

    pub fn finish(self) -> Vec<Descriptor> {
        self.out
    }
}

/// A strided run whose pieces touch on both sides is one contiguous copy.
fn normalize(d: Descriptor) -> Descriptor {
    if d.count == 1 {
        return Descriptor { src_stride: 0, dst_stride: 0, ..d };
    }
    if d.src_stride == d.len && d.dst_stride == d.len {
        return Descriptor::copy(d.kind, d.src_offset, d.dst_offset, d.len * d.count as u64);
    }
    d
}

fn merge(a: &Descriptor, b: &Descriptor) -> Option<Descriptor> {
    if a.kind != b.kind {
        return None;
    }
    // Contiguous continuation on both sides.
    if a.count == 1 && b.count == 1 && a.src_offset + a.len == b.src_offset && a.dst_offset + a.len == b.dst_offset {
        return Some(Descriptor { len: a.len + b.len, ..*a });
    }
    if a.len != b.len {
        return None;
    }
    // The stride `b` continues `a` with: a's own, b's own, or the gap between them.
    let (ss, ds) = if a.count > 1 {
        (a.src_stride, a.dst_stride)
    } else if b.count > 1 {
        (b.src_stride, b.dst_stride)
    } else {
        (b.src_offset.checked_sub(a.src_offset)?, b.dst_offset.checked_sub(a.dst_offset)?)
    };
    if b.count > 1 && (b.src_stride != ss || b.dst_stride != ds) {
        return None;
    }
    // Pieces must stay disjoint and ordered on both sides.
    if ss < a.len || ds < a.len {
        return None;
    }
    let n = a.count as u64;
    if b.src_offset != a.src_offset + n * ss || b.dst_offset != a.dst_offset + n * ds {
        return None;
    }
    let count = a.count.checked_add(b.count)?;
    Some(Descriptor { count, src_stride: ss, dst_stride: ds, ..*a })
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_components::vocab::RegionKind;
    use proptest::prelude::*;

    fn pieces(ds: &[Descriptor]) -> Vec<(u64, u64, u64)> {
        // Expand to byte-granular (src, dst) pairs, so merged and unmerged compare equal.
        let mut v = Vec::new();
        for d in ds {
            for (s, t) in d.pieces() {
                for i in 0..d.len {
                    v.push((s + i, t + i, 1));
                }
            }
        }
        v.sort();
        v
    }

    #[test]
    fn adjacent_copies_merge_into_one() {
        let mut c = Coalescer::default();
        for i in 0..10 {
            c.push(Descriptor::copy(RegionKind::MlaKv, i * 8, 100 + i * 8, 8));
        }
        assert_eq!(c.finish(), vec![Descriptor::copy(RegionKind::MlaKv, 0, 100, 80)]);
    }

    #[test]
    fn repeating_copies_become_one_strided_descriptor() {
        let mut c = Coalescer::default();
        for i in 0..16 {
            c.push(Descriptor::copy(RegionKind::MlaKv, i * 64, i * 8, 8));
        }
        let out = c.finish();
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].count, out[0].src_stride, out[0].dst_stride), (16, 64, 8));
    }

    proptest! {
        // Invariant: coalescing preserves exactly the set of bytes copied (src -> dst).
        #[test]
        fn coalescing_preserves_the_copied_bytes(
            items in proptest::collection::vec((0u64..6, 0u64..6, 1u64..4, 1u32..4, 0u64..3, 0u64..3), 1..20)
        ) {
            let mut raw = Vec::new();
            let (mut s, mut t) = (0u64, 0u64);
            for (gs, gd, len, count, es, ed) in items {
                s += gs; t += gd;
                let d = Descriptor { kind: RegionKind::KdaConv, src_offset: s, dst_offset: t, len, count, src_stride: len + es, dst_stride: len + ed };
                s = d.src_end(); t = d.dst_end();
                raw.push(Descriptor { src_stride: if count == 1 { 0 } else { d.src_stride }, dst_stride: if count == 1 { 0 } else { d.dst_stride }, ..d });
            }
            let mut c = Coalescer::default();
            for d in &raw { c.push(*d); }
            let merged = c.finish();
            prop_assert!(merged.len() <= raw.len());
            prop_assert_eq!(pieces(&merged), pieces(&raw));
        }
    }
}
