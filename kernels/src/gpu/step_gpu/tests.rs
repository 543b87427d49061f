//! The launch table against the kernel sources and the hipcc code objects,
//! without a device: a recording driver stands in for CUDA and HIP, the step
//! builds its launch lists through it, and every launch is held against the
//! signature of the kernel it names, parsed from `kernels/hip/`.

use std::collections::BTreeSet;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::*;
use crate::gpu::launch::DriverFault;
use crate::step::{StepKda, StepLayer, StepMla, StepModel, StepOptions, StepPlacement, StepRank, StepRegion, WeightDtype};

/// Launches a recorder keeps: the kernel, and whether it was a dependent launch.
type LaunchLog = Arc<std::sync::Mutex<Vec<(&'static str, bool)>>>;

/// A driver that runs nothing: kernels are their names, allocations are
/// distinct fake addresses, copies and launches are never made (the lists
/// are only built).
#[derive(Clone, Default)]
struct Recorder {
    next: Arc<AtomicU64>,
    /// Shared memory a block may take under HIP's rule (no opt-in past the
    /// LDS); None: CUDA's opt-in, anything the table asks.
    lds: Option<usize>,
    /// Where set, launches are recorded here (the kernel, and whether it was
    /// a dependent launch) instead of refused.
    launched: Option<LaunchLog>,
}

impl Recorder {
    fn record(&self, f: &'static str, dependent: bool) -> std::result::Result<(), DriverFault> {
        match &self.launched {
            Some(log) => {
                log.lock().unwrap().push((f, dependent));
                Ok(())
            }
            None => Err(DriverFault("the recorder launches nothing".into())),
        }
    }
}

impl Driver for Recorder {
    type Func = &'static str;
    type Graph = ();
    type Event = ();
    const NAME: &'static str = "recorder";
    const LABEL: &'static str = "recorder";
    const TYPE_PREFIX: &'static str = "Recorder";

    fn function(&self, name: &str) -> std::result::Result<&'static str, DriverFault> {
        // A device without the sm_90a warpgroup products: the table takes st_mm.
        STEP_KERNELS.iter().copied().find(|k| *k == name).ok_or_else(|| DriverFault(format!("{name} is not in the table")))
    }
    fn set_max_dynamic_smem(&self, _: &'static str, bytes: u32) -> std::result::Result<(), DriverFault> {
        match self.lds {
            #[cfg(feature = "hip")]
            Some(max) => crate::gpu::hip::lds_fits(bytes, max),
            _ => {
                let _ = bytes;
                Ok(())
            }
        }
    }
    fn prefer_shared_carveout(&self, _: &'static str) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    fn multiprocessors(&self) -> std::result::Result<usize, DriverFault> {
        Ok(132)
    }
    fn bind(&self) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    fn alloc(&self, bytes: usize) -> std::result::Result<u64, DriverFault> {
        Ok(0x1000_0000 + self.next.fetch_add(bytes.next_multiple_of(256) as u64, Ordering::Relaxed))
    }
    unsafe fn free(&self, _: u64) {}
    fn alloc_async(&self, bytes: usize) -> std::result::Result<u64, DriverFault> {
        self.alloc(bytes)
    }
    unsafe fn free_async(&self, _: u64) {}
    unsafe fn copy_dtod(&self, _: u64, _: u64, _: usize) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    unsafe fn memset_zero(&self, _: u64, _: usize) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    unsafe fn upload<T: Copy>(&self, _: u64, _: &[T]) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    unsafe fn download<T: Copy>(&self, _: &mut [T], _: u64) -> std::result::Result<(), DriverFault> {
        Err(DriverFault("the recorder has no device memory".into()))
    }
    unsafe fn launch(&self, f: &'static str, _: (u32, u32, u32), _: u32, _: u32, _: &mut [*mut c_void]) -> std::result::Result<(), DriverFault> {
        self.record(f, false)
    }
    fn dependent_launch(&self) -> bool {
        true
    }
    unsafe fn launch_dependent(&self, f: &'static str, _: (u32, u32, u32), _: u32, _: u32, _: &mut [*mut c_void]) -> std::result::Result<(), DriverFault> {
        self.record(f, true)
    }
    fn synchronize(&self) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    fn begin_capture(&self) -> std::result::Result<(), DriverFault> {
        Err(DriverFault("the recorder captures nothing".into()))
    }
    fn end_capture(&self) -> std::result::Result<Option<()>, DriverFault> {
        Ok(None)
    }
    fn prepare_graph(&self, _: &()) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    fn replay(&self, _: &()) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    fn record_event(&self) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    fn elapsed_ms(&self, _: &(), _: &()) -> std::result::Result<f32, DriverFault> {
        Ok(0.0)
    }
}

/// A model of one KDA and one MLA layer; `k3_rows` gives the MLA layer K3's
/// row shape (L = 512, R = 64, 8 heads) so that the tensor-core partial runs.
fn spec(weights: WeightDtype, cache: StorageDtype, k3_rows: bool, replay: usize, max_batch: usize) -> StepSpec {
    let (hid, vocab, inter): (usize, usize, usize) = (64, 96, 64);
    let (h, dk, dv, conv) = (2, 32, 32, 4);
    let (hm, l, r, dn, dvh) = if k3_rows { (8, 512, 64, 16, 16) } else { (2, 64, 16, 16, 16) };
    let c = h * (2 * dk + dv);
    let zeros = |n: usize| vec![0.01f32; n];
    let kda = StepMixer::Kda(StepKda {
        in_proj: StepMat::plain(hid, c + h * dk + h + h * dv, zeros(hid * (c + h * dk + h + h * dv))),
        conv: zeros(c * conv),
        a_log: zeros(h),
        dt_bias: zeros(h * dk),
        onorm: zeros(dv),
        wo: StepMat::units(h * dv, hid, h, zeros(h * dv * hid)),
    });
    let mla = StepMixer::Mla(StepMla {
        in_proj: StepMat::plain(hid, l + r + hm * (dn + r), zeros(hid * (l + r + hm * (dn + r)))),
        kv_norm: zeros(l),
        wuk: StepMat::grouped(hm, dn, l, zeros(hm * dn * l)),
        wuv: StepMat::grouped(hm, l, dvh, zeros(hm * l * dvh)),
        wo: StepMat::units(hm * dvh, hid, hm, zeros(hm * dvh * hid)),
    });
    let layer = |mixer| StepLayer {
        attn_norm: zeros(hid),
        mlp_norm: zeros(hid),
        mixer,
        gate_up: StepMat::plain(hid, 16 * inter.div_ceil(8), zeros(hid * 16 * inter.div_ceil(8))),
        down: StepMat::units(inter, hid, 4, zeros(inter * hid)),
    };
    let model = StepModel {
        hidden: hid,
        vocab,
        intermediate: inter,
        kda_heads: h,
        dk,
        dv,
        conv,
        mla_heads: hm,
        kv_lora_rank: l,
        rope_dim: r,
        nope_dim: dn,
        v_head_dim: dvh,
        replay,
        eps: 1e-6,
        mla_scale: 0.1,
        weights,
        cache,
        embed: zeros(vocab * hid),
        final_norm: zeros(hid),
        lm_head: StepMat::plain(hid, vocab, zeros(hid * vocab)),
        layers: vec![layer(kda), layer(mla)],
    };
    let region = |addr: u64| StepRegion { addr, len: 1 << 20, unit_stride: 1 << 12, units: 64, rows: vec![Some(0), Some(1 << 11)] };
    let rank = StepRank {
        state: region(0x7000_0000),
        conv: region(0x7100_0000),
        ring: (replay > 0).then(|| region(0x7200_0000)),
        cursor: (replay > 0).then(|| region(0x7300_0000)),
        mla: region(0x7400_0000),
    };
    let place = StepPlacement {
        tp: 1,
        dcp: 1,
        interleave: 1,
        block_size: 16,
        token_bytes: (l + r) * if cache == StorageDtype::F32 { 4 } else { 2 },
        max_context: 512,
        ranks: vec![rank],
    };
    StepSpec { model, place, options: StepOptions { max_batch, graphs: true, dependent_launch: true } }
}

/// The argument kinds of a kernel's parameter list, as [`Arg`] carries them
/// (and `S`: the units kernels' `hk_mm_units` table, passed by value ahead
/// of the [`Arg`]s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    P,
    L,
    I,
    F,
    D,
    S,
}

pub(crate) fn kind_of(a: &Arg) -> Kind {
    match a {
        Arg::P(_) => Kind::P,
        Arg::L(_) => Kind::L,
        Arg::I(_) => Kind::I,
        Arg::F(_) => Kind::F,
        Arg::D(_) => Kind::D,
    }
}

/// The body of `#define name`, its continuation lines joined.
fn macro_body(program: &str, name: &str) -> Option<String> {
    let head = format!("#define {name}");
    let mut lines = program
        .lines()
        .skip_while(|l| !l.trim_start().starts_with(&head) || l.trim_start()[head.len()..].starts_with(|c: char| c == '_' || c.is_alphanumeric()));
    let first = lines.next()?;
    let mut body = first.trim_start()[head.len()..].to_string();
    let mut cont = first.trim_end().ends_with('\\');
    for l in lines {
        if !cont {
            break;
        }
        cont = l.trim_end().ends_with('\\');
        body.push(' ');
        body.push_str(l);
    }
    Some(body.replace('\\', " "))
}

/// Where the parameter list of `extern "C" __global__` kernel `name` opens
/// and closes in `program` (just inside the parentheses), None where no such
/// kernel is declared.
fn param_list(program: &str, name: &str) -> Option<(usize, usize)> {
    let needle = format!(" {name}(");
    let at = program.match_indices(&needle).map(|(i, _)| i).find(|&i| {
        let decl = &program[program[..i].rfind("extern \"C\" __global__").unwrap_or(0)..i];
        decl.starts_with("extern \"C\" __global__") && !decl.contains([';', '{', '}'])
    })?;
    let open = at + needle.len();
    let mut depth = 1;
    let close = open
        + program[open..].find(|c: char| {
            depth += match c {
                '(' => 1,
                ')' => -1,
                _ => 0,
            };
            depth == 0
        })?;
    Some((open, close))
}

/// The parameter kinds of `extern "C" __global__` kernel `name` in the
/// program NVRTC compiles (the prelude and every source), None where no such
/// kernel is declared. A parameter list that is one macro (ST_MM_ARGS) is
/// expanded.
pub(crate) fn signature(program: &str, name: &str) -> Option<Vec<Kind>> {
    let (open, close) = param_list(program, name)?;
    // Line comments inside a parameter list (conv.hip's `// [T, C]`) are not parameters.
    let mut params = program[open..close].lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    let word = params.trim();
    if !word.is_empty() && word.chars().all(|c| c == '_' || c.is_ascii_alphanumeric()) {
        params = macro_body(program, word)?;
    }
    let kinds = params
        .split(',')
        .map(|p| {
            let p = p.trim();
            if p.contains('*') {
                Kind::P
            } else if p.contains("hk_i64") || p.contains("long long") {
                Kind::L
            } else if p.starts_with("double") || p.starts_with("const double") {
                Kind::D
            } else if p.starts_with("float") || p.starts_with("const float") {
                Kind::F
            } else if p.starts_with("int") || p.starts_with("const int") || p.starts_with("unsigned") {
                Kind::I
            } else if p.starts_with("hk_mm_units ") || p.starts_with("hk_copy_table ") || p.starts_with("hk_copy_table_small ") {
                Kind::S
            } else {
                panic!("kernel {name}: parameter {p:?} of a type the launch table does not carry")
            }
        })
        .collect();
    Some(kinds)
}

/// The step's specs between them take every kernel of the table: f32 and
/// bf16 weights (st_mm_w2 / st_mm_w2p2 and st_mm), few rows and many
/// (st_mm_few, st_reduce), K3's MLA rows in bf16 (st_mla_part_tc) and others
/// (st_mla_part), ReplaySSM (st_cursor).
fn specs() -> Vec<StepSpec> {
    vec![spec(WeightDtype::F32, StorageDtype::F32, false, 0, 128), spec(WeightDtype::Bf16, StorageDtype::Bf16, true, 4, 40)]
}

/// Every launch of every bucket passes as many arguments as its kernel
/// declares, each of the kind the kernel reads (a pointer, a 64-bit or 32-bit
/// integer, a float or a double), and the table names every kernel of
/// STEP_KERNELS somewhere: the one table both drivers launch matches the one
/// set of sources.
#[test]
fn every_launch_of_the_table_matches_its_kernels_signature() {
    let program = crate::gpu::device_program();
    let mut used = BTreeSet::new();
    for (si, spec) in specs().iter().enumerate() {
        let step = GpuStep::new(Recorder::default(), spec).unwrap_or_else(|e| panic!("spec {si}: {e}"));
        assert_eq!(step.lists.len(), spec.buckets().len(), "spec {si}: one list a bucket");
        for (bp, list) in &step.lists {
            assert!(!list.is_empty());
            for (i, l) in list.iter().enumerate() {
                used.insert(l.f);
                let want = signature(&program, l.f).unwrap_or_else(|| panic!("kernel {} is not declared in the sources", l.f));
                let got: Vec<Kind> = l.args.iter().map(kind_of).collect();
                assert_eq!(
                    got.len(),
                    want.len(),
                    "spec {si}, bucket {bp}, launch {i} ({} as {}): {} arguments, the kernel takes {}",
                    l.f,
                    l.name,
                    got.len(),
                    want.len()
                );
                if let Some(j) = (0..got.len()).find(|&j| got[j] != want[j]) {
                    panic!("spec {si}, bucket {bp}, launch {i} ({} as {}): argument {j} is {:?}, the kernel declares {:?}", l.f, l.name, got[j], want[j]);
                }
                assert!(l.grid.0 > 0 && l.grid.1 > 0 && l.grid.2 > 0 && l.block > 0, "{}: empty launch {:?} x {}", l.f, l.grid, l.block);
            }
        }
    }
    let all: BTreeSet<&str> = STEP_KERNELS.iter().copied().collect();
    assert_eq!(used, all, "the specs take every kernel of the table");
}

/// The parser itself reads what the sources say: the first and last
/// parameters of two kernels, checked by hand against hip/step.hip and
/// hip/step_mm.hip (a parser that read nothing would pass the test above only
/// if both lists were empty, which it also refuses).
#[test]
fn the_signature_parser_reads_the_sources() {
    let program = crate::gpu::device_program();
    assert_eq!(signature(&program, "st_argmax"), Some(vec![Kind::P, Kind::I, Kind::P]));
    let mm = signature(&program, "st_mm").expect("st_mm (ST_MM_ARGS) declared");
    assert_eq!(mm.len(), 26);
    assert_eq!((mm[0], mm[1], mm[10], mm[11], mm[25]), (Kind::P, Kind::L, Kind::P, Kind::I, Kind::I));
    assert_eq!(signature(&program, "st_mla_part").map(|s| *s.last().unwrap()), Some(Kind::D));
    assert_eq!(signature(&program, "no_such_kernel"), None);
}

/// The text of kernel `name`'s body from its opening brace on, None where no
/// such kernel is defined.
fn kernel_body<'a>(program: &'a str, name: &str) -> Option<&'a str> {
    let (_, close) = param_list(program, name)?;
    let brace = close + program[close..].find('{')?;
    Some(&program[brace + 1..])
}

/// Every kernel of the table begins with HK_GRID_DEP, the wait for the
/// kernel before it: the step launches each kernel but the first as a
/// programmatic dependent, and a kernel that read or wrote anything before
/// that wait would race the kernel before it (and one that could complete
/// without waiting would let the next run ahead of both).
#[test]
fn every_table_kernel_waits_for_the_one_before_first() {
    let program = crate::gpu::device_program();
    let dep = macro_body(&program, "HK_GRID_DEP").expect("prelude.h defines HK_GRID_DEP");
    assert!(dep.contains("griddepcontrol.wait"), "HK_GRID_DEP waits for the kernel before: {dep}");
    for name in STEP_KERNELS {
        let body = kernel_body(&program, name).unwrap_or_else(|| panic!("kernel {name} is not defined in the sources"));
        assert!(body.trim_start().starts_with("HK_GRID_DEP();"), "kernel {name} does not begin with HK_GRID_DEP(): {:?}", &body[..body.len().min(80)]);
    }
    let wg = macro_body(&program, "ST_MM_WG").expect("step_mm.hip defines ST_MM_WG");
    let body = &wg[wg.find('{').expect("ST_MM_WG has a body") + 1..];
    assert!(body.trim_start().starts_with("HK_GRID_DEP();"), "the warpgroup products do not begin with HK_GRID_DEP(): {body:?}");
}

/// A step's list goes out with every launch but the first as a dependent of
/// the one before, and all in plain stream order once turned off.
#[test]
fn the_step_launches_each_kernel_after_the_first_as_a_dependent() {
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let drv = Recorder { launched: Some(log.clone()), ..Recorder::default() };
    let mut step = GpuStep::new(drv, &specs()[0]).unwrap();
    assert!(step.describe().contains("dependent launches on"), "{}", step.describe());
    let bp = *step.buckets.last().unwrap();
    let want: Vec<&str> = step.lists[&bp].iter().map(|l| l.f).collect();
    step.launch_list(bp).unwrap();
    let got = std::mem::take(&mut *log.lock().unwrap());
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), want, "the list, in order");
    assert!(!got[0].1, "the first launch follows the tick's upload, a copy: not a dependent");
    assert!(got[1..].iter().all(|g| g.1), "every later launch is a dependent");
    step.set_dependent_launch(false);
    assert!(step.describe().contains("dependent launches off"));
    step.launch_list(bp).unwrap();
    let got = std::mem::take(&mut *log.lock().unwrap());
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|g| !g.1), "off: plain stream order");
}

/// Where more than 16 rows make a product into the residual write partials,
/// their sum and the next RMSNorm go as one st_reduce_rms right after the
/// product; no residual st_reduce is left followed by an st_rms_pack (the
/// two the fused kernel replaces), and with 16 rows or fewer st_mm_few sums
/// its own segments and st_rms_pack follows it.
#[test]
fn the_residual_sum_and_the_next_norm_are_one_launch_past_16_rows() {
    for (si, spec) in specs().iter().enumerate() {
        let step = GpuStep::new(Recorder::default(), spec).unwrap();
        for (bp, list) in &step.lists {
            let names: Vec<&str> = list.iter().map(|l| l.f).collect();
            let fused = names.iter().filter(|n| **n == "st_reduce_rms").count();
            if *bp > 16 {
                assert!(fused > 0, "spec {si}, bucket {bp}: no fused launch in {names:?}");
            } else {
                assert_eq!(fused, 0, "spec {si}, bucket {bp}: st_mm_few sums its own segments");
            }
            for w in names.windows(2) {
                assert!(!(w[0] == "st_reduce" && w[1] == "st_rms_pack"), "spec {si}, bucket {bp}: a sum and a norm left apart in {names:?}");
                if w[1] == "st_reduce_rms" {
                    assert!(w[0].starts_with("st_mm"), "spec {si}, bucket {bp}: st_reduce_rms after {}", w[0]);
                }
            }
        }
    }
}

/// Symbol names of the ELF64 objects in a clang offload bundle (the hipcc
/// code objects of build.rs), from their .symtab and .dynsym sections.
#[cfg(feature = "hip")]
pub(crate) fn bundle_symbols(bundle: &[u8]) -> BTreeSet<String> {
    let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
    let u32_at = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
    let u16_at = |b: &[u8], at: usize| u16::from_le_bytes(b[at..at + 2].try_into().unwrap()) as usize;
    const MAGIC: &[u8] = b"__CLANG_OFFLOAD_BUNDLE__";
    assert!(bundle.starts_with(MAGIC), "not a clang offload bundle");
    let entries = u64_at(bundle, MAGIC.len());
    let mut at = MAGIC.len() + 8;
    let mut names = BTreeSet::new();
    for _ in 0..entries {
        let (off, size, tlen) = (u64_at(bundle, at), u64_at(bundle, at + 8), u64_at(bundle, at + 16));
        let triple = String::from_utf8_lossy(&bundle[at + 24..at + 24 + tlen]).into_owned();
        at += 24 + tlen;
        if !triple.contains("amdgcn") || size == 0 {
            continue;
        }
        let elf = &bundle[off..off + size];
        assert!(elf.starts_with(b"\x7fELF") && elf[4] == 2, "{triple}: not an ELF64 object");
        let (shoff, shentsize, shnum) = (u64_at(elf, 0x28), u16_at(elf, 0x3a), u16_at(elf, 0x3c));
        let section = |i: usize| &elf[shoff + i * shentsize..shoff + (i + 1) * shentsize];
        for i in 0..shnum {
            let sh = section(i);
            // SHT_SYMTAB (2) and SHT_DYNSYM (11); sh_link is the string table.
            if !matches!(u32_at(sh, 4), 2 | 11) {
                continue;
            }
            let (sym_off, sym_size) = (u64_at(sh, 0x18), u64_at(sh, 0x20));
            let strtab = section(u32_at(sh, 0x28));
            let strs = &elf[u64_at(strtab, 0x18)..u64_at(strtab, 0x18) + u64_at(strtab, 0x20)];
            for sym in elf[sym_off..sym_off + sym_size].chunks_exact(24) {
                let name = &strs[u32_at(sym, 0)..];
                let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
                if end > 0 {
                    names.insert(String::from_utf8_lossy(&name[..end]).into_owned());
                }
            }
        }
    }
    names
}

/// Every kernel of the table is a kernel of the gfx90a code objects that
/// HipBackend::new loads: its symbol and its kernel descriptor (`name.kd`,
/// what hipModuleGetFunction resolves) are there. The warpgroup products are
/// not (they are built only for sm_90a), which the table tolerates.
#[cfg(feature = "hip")]
#[test]
fn every_table_kernel_is_in_the_gfx90a_code_objects() {
    let mut symbols = BTreeSet::new();
    for (name, co) in crate::gpu::HIP_CODE_OBJECTS {
        let s = bundle_symbols(co);
        assert!(!s.is_empty(), "{name}: no symbols read from its code object");
        symbols.extend(s);
    }
    for k in STEP_KERNELS {
        assert!(symbols.contains(k), "{k}: no symbol in the gfx90a code objects");
        assert!(symbols.contains(&format!("{k}.kd")), "{k}: no kernel descriptor {k}.kd in the gfx90a code objects");
    }
    assert!(!symbols.contains("st_mm_wg32_1.kd"), "st_mm_wg is sm_90a-only, yet a gfx90a kernel of that name exists");
}

/// On a HIP device with gfx90a's 64 KiB of LDS a block, the table's
/// Hopper-sized products (st_mm stages up to 226 KiB) cannot launch: building
/// the step refuses with a typed error naming the kernel and the bytes,
/// instead of a launch failing at every replay. This is the state of the HIP
/// path today (the kernels are not edited here); the test pins that it is a
/// clear refusal.
#[cfg(feature = "hip")]
#[test]
fn a_64_kib_lds_device_refuses_the_step_naming_the_kernel() {
    let drv = Recorder { lds: Some(64 * 1024), ..Recorder::default() };
    let e = GpuStep::new(drv, &specs()[0]).err().expect("the step fits 64 KiB of LDS: update the README's HIP note");
    let KernelError::BackendUnavailable(msg) = &e else { panic!("wrong error {e:?}") };
    assert!(msg.starts_with("recorder: cannot give st_mm"), "{msg}");
    assert!(msg.contains("past the device's 65536 (LDS)"), "{msg}");
}
