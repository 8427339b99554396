//! CPU kernels for the convolutional models: one image at a time, fused and cache-sized.
//!
//! Built from candle's ops, an MBConv block makes several full passes over tensors of
//! ~5 MB per image (1×1 convolution as a batched matmul, then a separate bias add, then
//! a separate clamp, each into a fresh allocation that the kernel page-faults in), and
//! candle's im2col for the stem is scalar code. These kernels instead:
//!
//! - run a 1×1 convolution as one `gemm` call per column chunk into an output already
//!   holding the bias (and the residual), clamping the chunk while it is in cache;
//! - run the expansion and the depthwise convolution of a block channel tile by channel
//!   tile, so the expanded tensor (6× the block's input) never leaves L2;
//! - run depthwise convolutions over a zero-padded plane split into stride × stride
//!   phases, so that every tap reads one contiguous run for the whole output plane;
//!   32 outputs at a time stay in registers across all taps (row-by-row `axpy`s, the
//!   first version, ran 14×14 and 7×7 planes at 2–3 GFLOP/s: a 14-wide row is one
//!   vector and a scalar tail), compiled for AVX-512 or AVX2+FMA when the CPU has them;
//! - run dense convolutions (stems, ResNet blocks) as im2col + `gemm` a chunk of
//!   output rows at a time, reading taps from the same padded planes;
//! - reuse per-thread scratch buffers instead of allocating per stage.
//!
//! Every kernel works on one image; callers parallelise over the batch.

use std::cell::RefCell;

use candle_core::{CpuStorage, Tensor};
use rayon::prelude::*;

/// Instruction sets the kernels are compiled for, picked once at run time (x86-64;
/// aarch64 always has fused multiply-add, and NEON is its baseline).
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    Avx512,
    Avx2,
    Base,
}

#[cfg(target_arch = "x86_64")]
fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        let fma = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        if fma && is_x86_feature_detected!("avx512f") {
            return Isa::Avx512;
        }
        if fma {
            return Isa::Avx2;
        }
        Isa::Base
    })
}

/// Defines `pub(crate) fn $name(args)` that calls `$body::<true>` compiled for AVX-512
/// or AVX2+FMA when the CPU has them, else `$body::<false>` (no fused multiply-add,
/// which without hardware support would be a slow library call); on aarch64,
/// `$body::<true>` (its fused multiply-add is a NEON instruction).
macro_rules! multiversion {
    ($(#[$doc:meta])* fn $name:ident($($a:ident: $t:ty),* $(,)?) => $body:ident;) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn $name($($a: $t),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn v4($($a: $t),*) {
                    $body::<true>($($a),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn v3($($a: $t),*) {
                    $body::<true>($($a),*)
                }
                match isa() {
                    // SAFETY: `isa()` found these features on this CPU.
                    Isa::Avx512 => return unsafe { v4($($a),*) },
                    // SAFETY: as above.
                    Isa::Avx2 => return unsafe { v3($($a),*) },
                    Isa::Base => {}
                }
            }
            #[cfg(target_arch = "aarch64")]
            return $body::<true>($($a),*);
            #[cfg(not(target_arch = "aarch64"))]
            $body::<false>($($a),*)
        }
    };
}

/// The activation a kernel applies to its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Act {
    None,
    /// max(0, ·).
    Relu,
    /// min(max(0, ·), 6).
    Relu6,
}

impl Act {
    #[inline(always)]
    fn apply(self, o: &mut [f32]) {
        match self {
            Act::None => {}
            Act::Relu => {
                for v in o {
                    *v = v.max(0.0);
                }
            }
            Act::Relu6 => {
                for v in o {
                    *v = v.clamp(0.0, 6.0);
                }
            }
        }
    }
}

/// Per-thread scratch: one padded plane, a tile (expanded channels or im2col
/// columns), and whole-image planes (depthwise outputs or padded inputs).
#[derive(Default)]
struct Scratch {
    pad: Vec<f32>,
    tile: Vec<f32>,
    planes: Vec<f32>,
    /// A depthwise kernel's flat accumulator.
    acc: Vec<f32>,
    /// A depthwise kernel's padded input.
    phases: Phases,
}

/// A zero-padded plane in the depthwise layout of one geometry (see [`pad_phases`]).
#[derive(Default)]
struct Phases {
    buf: Vec<f32>,
    /// The geometry `buf` is laid out for: its padding and slack are zero, and only
    /// the interior is rewritten while planes of this geometry follow one another.
    geom: Option<Window>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

// The kernels take the scratch out and put it back rather than work inside
// `SCRATCH.with(|s| ..)`: a closure is compiled as its own function, without the
// AVX-512/AVX2 features of the `multiversion!` wrapper it is inlined into, and
// `f32::mul_add` there becomes a libm call per element.
fn take_scratch() -> Scratch {
    SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()))
}

fn put_scratch(s: Scratch) {
    SCRATCH.with(|c| *c.borrow_mut() = s)
}

/// Geometry of a `k×k` convolution with symmetric zero padding `k / 2` and stride 1 or
/// 2 over an `h×w` plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    pub h: usize,
    pub w: usize,
    pub k: usize,
    pub(crate) stride: usize,
}

impl Window {
    fn pad(&self) -> usize {
        self.k / 2
    }
    /// Output height and width.
    pub(super) fn out(&self) -> (usize, usize) {
        let p = self.pad();
        (
            (self.h + 2 * p - self.k) / self.stride + 1,
            (self.w + 2 * p - self.k) / self.stride + 1,
        )
    }
    /// Width of a padded row.
    fn wp(&self) -> usize {
        self.w + 2 * self.pad()
    }
    /// Elements of a padded plane.
    fn padded(&self) -> usize {
        (self.h + 2 * self.pad()) * self.wp()
    }
    /// Where, in a padded row (see [`pad_plane`]), the `ow` inputs of tap column `kx`
    /// for output row positions `0..ow` start.
    #[inline(always)]
    fn tap_start(&self, kx: usize) -> usize {
        match (self.stride, kx % 2) {
            (1, _) => kx,
            (_, 0) => kx / 2,
            _ => self.wp().div_ceil(2) + kx / 2,
        }
    }
    /// Padded row `ky` of the window of output row `oy`.
    #[inline(always)]
    fn padded_row<'p>(&self, pad: &'p [f32], oy: usize, ky: usize) -> &'p [f32] {
        let (r, wp) = (oy * self.stride + ky, self.wp());
        &pad[r * wp..(r + 1) * wp]
    }
}

/// Copies plane `src` (`h×w`) into `dst` with a zero border of `k / 2`. For stride 2
/// each padded row is stored as its even columns followed by its odd columns.
fn pad_plane(dst: &mut Vec<f32>, src: &[f32], g: Window) {
    let (p, wp) = (g.pad(), g.wp());
    dst.clear();
    dst.resize(g.padded(), 0.0);
    let ne = wp.div_ceil(2);
    for y in 0..g.h {
        let row = &mut dst[(y + p) * wp..(y + p + 1) * wp];
        let s = &src[y * g.w..(y + 1) * g.w];
        if g.stride == 1 {
            row[p..p + g.w].copy_from_slice(s);
        } else {
            for (x, v) in s.iter().enumerate() {
                let j = x + p;
                row[if j % 2 == 0 { j / 2 } else { ne + j / 2 }] = *v;
            }
        }
    }
}

/// Output positions a depthwise kernel computes per step, kept in registers across
/// all the taps (two AVX-512 or four AVX2 vectors).
const DW_STEP: usize = 32;

impl Window {
    /// Width of one phase plane of a depthwise layout (see [`pad_phases`]).
    fn phase_w(&self) -> usize {
        self.wp().div_ceil(self.stride)
    }
    /// Elements of one phase plane.
    fn phase_len(&self) -> usize {
        (self.h + 2 * self.pad()).div_ceil(self.stride) * self.phase_w()
    }
    /// Output positions of the flat depthwise accumulator: `oh` rows of `phase_w`
    /// (the columns past `ow` are discarded), rounded up to whole steps.
    fn flat_out(&self) -> usize {
        (self.out().0 * self.phase_w()).next_multiple_of(DW_STEP)
    }
    /// Where tap `(ky, kx)` starts reading in a depthwise layout: output `j` of the
    /// flat accumulator reads element `tap_offset + j`.
    fn tap_offset(&self, ky: usize, kx: usize) -> usize {
        let s = self.stride;
        (ky % s * s + kx % s) * self.phase_len() + (ky / s) * self.phase_w() + kx / s
    }
}

/// Copies plane `src` (`h×w`) into a zero-padded depthwise layout: the padded plane
/// split into `stride × stride` phase planes (rows `r ≡ a`, columns `c ≡ b` mod
/// stride), each `phase_w` wide, plus slack so that every tap can read whole steps.
/// Every tap of every output row then reads one contiguous run, and a whole output
/// plane (as rows `phase_w` apart) is one run per tap.
fn pad_phases(dst: &mut Phases, src: &[f32], g: Window) {
    let (p, s, pw, pl) = (g.pad(), g.stride, g.phase_w(), g.phase_len());
    assert!(s == 1 || s == 2, "depthwise strides are 1 or 2");
    if dst.geom != Some(g) {
        let last = (0..g.k * g.k)
            .map(|t| g.tap_offset(t / g.k, t % g.k))
            .max()
            .unwrap_or(0);
        dst.buf.clear();
        dst.buf.resize((s * s * pl).max(last + g.flat_out()), 0.0);
        dst.geom = Some(g);
    }
    let buf = &mut dst.buf;
    // Columns `x` of a source row whose padded column `x + p` is even, and the
    // first such column's place in the even phase (likewise odd).
    let (xe, xo) = (p & 1, 1 - (p & 1));
    let (je, jo) = ((xe + p) >> 1, (xo + p) >> 1);
    for y in 0..g.h {
        let r = y + p;
        let row = &src[y * g.w..(y + 1) * g.w];
        if s == 1 {
            buf[r * pw + p..r * pw + p + g.w].copy_from_slice(row);
        } else {
            // Stride 2: the row's even and odd padded columns go to two phases.
            let base = (r & 1) * 2 * pl + (r >> 1) * pw;
            let (even, odd) = buf[base..base + pl + pw].split_at_mut(pl);
            for (d, v) in even[je..].iter_mut().zip(row.iter().skip(xe).step_by(2)) {
                *d = *v;
            }
            for (d, v) in odd[jo..].iter_mut().zip(row.iter().skip(xo).step_by(2)) {
                *d = *v;
            }
        }
    }
}

/// One depthwise output plane: `out = act(bias + conv(src, taps))`; `pad` and `acc`
/// are scratch. The whole plane accumulates as one flat run (rows `phase_w` apart),
/// [`DW_STEP`] outputs at a time held in registers across all `k×k` taps, so small
/// planes (14×14, 7×7) vectorise as well as large ones.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn depthwise_plane<const FMA: bool>(
    out: &mut [f32],
    src: &[f32],
    taps: &[f32],
    bias: f32,
    g: Window,
    act: Act,
    pad: &mut Phases,
    acc: &mut Vec<f32>,
) {
    const MAX_TAPS: usize = 49;
    let kk = g.k * g.k;
    assert!(kk <= MAX_TAPS && taps.len() == kk);
    pad_phases(pad, src, g);
    let mut offs = [0usize; MAX_TAPS];
    for ky in 0..g.k {
        for kx in 0..g.k {
            offs[ky * g.k + kx] = g.tap_offset(ky, kx);
        }
    }
    let n = g.flat_out();
    // Every step of `acc` is written below; no need to clear it.
    acc.resize(n, 0.0);
    // Every tap's run of `n` stays inside `pad` (see `pad_phases`).
    let pad = &pad.buf;
    assert!(offs[..kk].iter().all(|&o| o + n <= pad.len()));
    for (i, chunk) in acc.chunks_exact_mut(DW_STEP).enumerate() {
        let mut r = [bias; DW_STEP];
        for t in 0..kk {
            let start = offs[t] + i * DW_STEP;
            let x: &[f32; DW_STEP] = pad[start..start + DW_STEP]
                .try_into()
                .expect("a slice of DW_STEP elements");
            let w = taps[t];
            for j in 0..DW_STEP {
                r[j] = if FMA {
                    x[j].mul_add(w, r[j])
                } else {
                    r[j] + w * x[j]
                };
            }
        }
        chunk.copy_from_slice(&r);
    }
    let (oh, ow) = g.out();
    let pw = g.phase_w();
    for oy in 0..oh {
        let o = &mut out[oy * ow..(oy + 1) * ow];
        o.copy_from_slice(&acc[oy * pw..oy * pw + ow]);
        act.apply(o);
    }
}

/// `dst[:, c0..c0 + n] = act(b + w × rhs (+ residual))` for a `cout × ld` row-major
/// `dst`, `w` `[cout, depth]`, and `rhs` `[depth, n]` with rows `rhs_rs` apart.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gemm_chunk(
    dst: &mut [f32],
    ld: usize,
    (c0, n): (usize, usize),
    w: &[f32],
    b: &[f32],
    rhs: &[f32],
    rhs_rs: usize,
    residual: Option<&[f32]>,
    act: Act,
) {
    let cout = b.len();
    let depth = w.len() / cout;
    assert!(
        dst.len() == cout * ld
            && c0 + n <= ld
            && w.len() == cout * depth
            && rhs.len() >= (depth - 1) * rhs_rs + n
            && residual.is_none_or(|r| r.len() == dst.len())
    );
    for o in 0..cout {
        let row = &mut dst[o * ld + c0..o * ld + c0 + n];
        match residual {
            Some(r) => {
                for (d, r) in row.iter_mut().zip(&r[o * ld + c0..o * ld + c0 + n]) {
                    *d = b[o] + r;
                }
            }
            None => row.fill(b[o]),
        }
    }
    // SAFETY: the shapes are asserted above: every row of dst holds `[c0, c0 + n)`,
    // w is `cout × depth` and rhs `depth` rows of `n` elements, `rhs_rs` apart.
    unsafe {
        gemm::gemm(
            cout,
            n,
            depth,
            dst.as_mut_ptr().add(c0),
            1,
            ld as isize,
            true,
            w.as_ptr(),
            1,
            depth as isize,
            rhs.as_ptr(),
            1,
            rhs_rs as isize,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
    for o in 0..cout {
        act.apply(&mut dst[o * ld + c0..o * ld + c0 + n]);
    }
}

/// 1×1 convolution of one image: `dst[o] = act(b[o] + Σ_i w[o, i] x[i] (+ residual[o]))`.
/// `x`: `[cin, hw]`, `w`: `[cout, cin]`, `dst`: `[cout, hw]`.
#[inline(always)]
fn pointwise_body<const FMA: bool>(
    dst: &mut [f32],
    x: &[f32],
    w: &[f32],
    b: &[f32],
    hw: usize,
    act: Act,
    residual: Option<&[f32]>,
) {
    let cout = b.len();
    assert!(x.len() * cout == w.len() * hw);
    // Column chunks of about 256 KB of output, so the activation finds them in cache.
    let chunk = ((64 * 1024) / cout)
        .clamp(64, hw.max(64))
        .next_multiple_of(16);
    let mut c0 = 0;
    while c0 < hw {
        let n = chunk.min(hw - c0);
        gemm_chunk(dst, hw, (c0, n), w, b, &x[c0..], hw, residual, act);
        c0 += n;
    }
}

multiversion! {
    /// 1×1 convolution of one image (see `pointwise_body`).
    fn pointwise(
        dst: &mut [f32],
        x: &[f32],
        w: &[f32],
        b: &[f32],
        hw: usize,
        act: Act,
        residual: Option<&[f32]>,
    ) => pointwise_body;
}

/// Dense convolution of one image through im2col + GEMM, a chunk of output rows at a
/// time (the columns of a chunk stay in L2): `dst = act(b + conv(x, w) (+ residual))`.
/// `w`: `[cout, cin, k, k]`. A 1×1 stride-1 convolution skips the copy.
#[inline(always)]
fn conv_body<const FMA: bool>(
    dst: &mut [f32],
    x: &[f32],
    w: &[f32],
    b: &[f32],
    g: Window,
    act: Act,
    residual: Option<&[f32]>,
) {
    let cout = b.len();
    let kk = g.k * g.k;
    let depth = w.len() / cout;
    let cin = depth / kk;
    let (oh, ow) = g.out();
    let ohw = oh * ow;
    let plane = g.h * g.w;
    assert!(x.len() == cin * plane && dst.len() == cout * ohw && depth == cin * kk);
    if g.k == 1 && g.stride == 1 {
        return pointwise_body::<FMA>(dst, x, w, b, ohw, act, residual);
    }
    let mut s = take_scratch();
    // Every input plane padded once, side by side.
    let padded = g.padded();
    s.planes.clear();
    for i in 0..cin {
        pad_plane(&mut s.pad, &x[i * plane..(i + 1) * plane], g);
        s.planes.extend_from_slice(&s.pad);
    }
    let rows = ((128 * 1024) / (depth * ow).max(1)).clamp(1, oh);
    let mut oy0 = 0;
    while oy0 < oh {
        let nr = rows.min(oh - oy0);
        let n = nr * ow;
        // Every element is copied below: resizing without clearing skips a memset.
        s.tile.resize(depth * n, 0.0);
        for i in 0..cin {
            let src = &s.planes[i * padded..(i + 1) * padded];
            for ky in 0..g.k {
                for kx in 0..g.k {
                    let r = (i * kk + ky * g.k + kx) * n;
                    let start = g.tap_start(kx);
                    for y in 0..nr {
                        let prow = g.padded_row(src, oy0 + y, ky);
                        s.tile[r + y * ow..r + (y + 1) * ow]
                            .copy_from_slice(&prow[start..start + ow]);
                    }
                }
            }
        }
        gemm_chunk(dst, ohw, (oy0 * ow, n), w, b, &s.tile, n, residual, act);
        oy0 += nr;
    }
    put_scratch(s);
}

multiversion! {
    /// Dense convolution of one image (see `conv_body`).
    fn conv(
        dst: &mut [f32],
        x: &[f32],
        w: &[f32],
        b: &[f32],
        g: Window,
        act: Act,
        residual: Option<&[f32]>,
    ) => conv_body;
}

/// The weights of one MBConv block, as slices.
pub(crate) struct MbConv<'a> {
    /// `[mid, cin]` and `[mid]`, when the block expands.
    pub expand: Option<(&'a [f32], &'a [f32])>,
    /// `[mid, k, k]` and `[mid]`.
    pub(crate) dw: (&'a [f32], &'a [f32]),
    /// `[cout, mid]` and `[cout]`.
    pub project: (&'a [f32], &'a [f32]),
    /// The depthwise window over the block's input plane.
    pub window: Window,
    /// Whether the input is added to the output.
    pub skip: bool,
}

/// One MBConv block on one image: expand (1×1, ReLU6) and depthwise (ReLU6) a channel
/// tile at a time, then project (1×1) with the residual.
#[inline(always)]
fn mbconv_body<const FMA: bool>(dst: &mut [f32], x: &[f32], m: &MbConv<'_>) {
    let g = m.window;
    let hw = g.h * g.w;
    let (oh, ow) = g.out();
    let ohw = oh * ow;
    let mid = m.dw.1.len();
    let kk = g.k * g.k;
    let mut s = take_scratch();
    // Every plane is written by `depthwise_plane`: no need to clear.
    s.planes.resize(mid * ohw, 0.0);
    // Channels per tile: about 256 KB of expanded activations, at least 16 rows for
    // the GEMM's microkernel.
    let tile = ((64 * 1024) / hw).clamp(16, mid.max(16)).min(mid);
    let mut c0 = 0;
    while c0 < mid {
        let tn = tile.min(mid - c0);
        let src: &[f32] = match m.expand {
            Some((we, be)) => {
                let cin = we.len() / mid;
                // `pointwise_body` writes every element: no need to clear.
                s.tile.resize(tn * hw, 0.0);
                let (w, b) = (&we[c0 * cin..(c0 + tn) * cin], &be[c0..c0 + tn]);
                pointwise_body::<FMA>(&mut s.tile, x, w, b, hw, Act::Relu6, None);
                &s.tile
            }
            None => &x[c0 * hw..(c0 + tn) * hw],
        };
        for c in 0..tn {
            let ch = c0 + c;
            depthwise_plane::<FMA>(
                &mut s.planes[ch * ohw..(ch + 1) * ohw],
                &src[c * hw..(c + 1) * hw],
                &m.dw.0[ch * kk..(ch + 1) * kk],
                m.dw.1[ch],
                g,
                Act::Relu6,
                &mut s.phases,
                &mut s.acc,
            );
        }
        c0 += tn;
    }
    let (w, b) = m.project;
    pointwise_body::<FMA>(dst, &s.planes, w, b, ohw, Act::None, m.skip.then_some(x));
    put_scratch(s);
}

multiversion! {
    /// One MBConv block on one image (see `mbconv_body`).
    fn mbconv(dst: &mut [f32], x: &[f32], m: &MbConv<'_>) => mbconv_body;
}

/// Depthwise `k×k` convolution + bias + activation of one image: `x` `[c, h, w]`, `w`
/// `[c, k, k]`.
#[inline(always)]
fn depthwise_body<const FMA: bool>(
    dst: &mut [f32],
    x: &[f32],
    w: &[f32],
    b: &[f32],
    g: Window,
    act: Act,
) {
    let (oh, ow) = g.out();
    let kk = g.k * g.k;
    let hw = g.h * g.w;
    let mut s = take_scratch();
    for (ch, out) in dst.chunks_mut(oh * ow).enumerate() {
        let (src, taps) = (&x[ch * hw..(ch + 1) * hw], &w[ch * kk..(ch + 1) * kk]);
        depthwise_plane::<FMA>(out, src, taps, b[ch], g, act, &mut s.phases, &mut s.acc);
    }
    put_scratch(s);
}

multiversion! {
    /// Depthwise convolution of one image (see `depthwise_body`).
    fn depthwise(dst: &mut [f32], x: &[f32], w: &[f32], b: &[f32], g: Window, act: Act) => depthwise_body;
}

/// Max pooling over `k×k` windows (padding `k / 2`) of non-negative planes (after a
/// ReLU, so zero padding is the same as ignoring the border).
pub(crate) fn max_pool(dst: &mut [f32], x: &[f32], g: Window) {
    let (oh, ow) = g.out();
    let hw = g.h * g.w;
    let mut s = take_scratch();
    for (ch, out) in dst.chunks_mut(oh * ow).enumerate() {
        pad_plane(&mut s.pad, &x[ch * hw..(ch + 1) * hw], g);
        out.fill(0.0);
        for oy in 0..oh {
            let orow = &mut out[oy * ow..(oy + 1) * ow];
            for ky in 0..g.k {
                let prow = g.padded_row(&s.pad, oy, ky);
                for kx in 0..g.k {
                    let start = g.tap_start(kx);
                    for (o, v) in orow.iter_mut().zip(&prow[start..start + ow]) {
                        *o = o.max(*v);
                    }
                }
            }
        }
    }
    put_scratch(s);
}

/// Mean of each of `dst.len()` planes of `x`.
pub(crate) fn mean_planes(dst: &mut [f32], x: &[f32]) {
    let hw = x.len() / dst.len().max(1);
    for (d, plane) in dst.iter_mut().zip(x.chunks(hw)) {
        *d = plane.iter().sum::<f32>() / hw as f32;
    }
}

/// A CPU tensor's float32 data, borrowed for as long as this lives.
pub(crate) struct Host<'a> {
    storage: candle_core::StorageRef<'a>,
    layout: &'a candle_core::Layout,
}

impl<'a> Host<'a> {
    pub(super) fn new(t: &'a Tensor) -> Self {
        let (storage, layout) = t.storage_and_layout();
        Host { storage, layout }
    }

    /// The contiguous float32 elements.
    pub(super) fn slice(&self) -> candle_core::Result<&[f32]> {
        match (&*self.storage, self.layout.contiguous_offsets()) {
            (candle_core::Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(&v[a..b]),
            (candle_core::Storage::Cpu(CpuStorage::F32(_)), None) => {
                candle_core::bail!("expected a contiguous tensor")
            }
            _ => candle_core::bail!("expected a float32 tensor on the CPU"),
        }
    }
}

/// Runs `f(output image, input image)` over the images of `x` (`[N, ...]`, float32 on
/// the CPU) in parallel on the current rayon pool, into a new `[N, out_shape...]`.
pub(crate) fn per_image(
    x: &Tensor,
    out_shape: &[usize],
    f: impl Fn(&mut [f32], &[f32]) + Sync,
) -> candle_core::Result<Tensor> {
    let x = x.contiguous()?;
    let n = x.dim(0)?;
    let per_out: usize = out_shape.iter().product();
    let per_in = x.elem_count() / n.max(1);
    let host = Host::new(&x);
    let src = host.slice()?;
    let mut out = vec![0f32; n * per_out];
    out.par_chunks_mut(per_out.max(1))
        .zip(src.par_chunks(per_in.max(1)))
        .for_each(|(o, i)| f(o, i));
    let mut shape = vec![n];
    shape.extend_from_slice(out_shape);
    Tensor::from_vec(out, shape, x.device())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Depthwise convolution by the definition, one plane.
    fn reference(src: &[f32], taps: &[f32], bias: f32, g: Window) -> Vec<f32> {
        let (oh, ow) = g.out();
        let p = g.pad() as isize;
        let mut out = vec![bias; oh * ow];
        for oy in 0..oh {
            for ox in 0..ow {
                for ky in 0..g.k {
                    for kx in 0..g.k {
                        let y = (oy * g.stride + ky) as isize - p;
                        let x = (ox * g.stride + kx) as isize - p;
                        if (0..g.h as isize).contains(&y) && (0..g.w as isize).contains(&x) {
                            out[oy * ow + ox] +=
                                taps[ky * g.k + kx] * src[y as usize * g.w + x as usize];
                        }
                    }
                }
                out[oy * ow + ox] = out[oy * ow + ox].clamp(0.0, 6.0);
            }
        }
        out
    }

    #[test]
    fn depthwise_matches_the_definition_for_every_shape_it_meets() {
        // Odd and even sizes, both strides, both kernel sizes, and planes of
        // different geometries one after another through the same scratch (the
        // padded layout is reused only while the geometry stays the same).
        let mut seed = 1u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        for &(h, w) in &[(7, 7), (14, 14), (1, 1), (2, 3), (9, 16), (33, 31)] {
            for k in [3, 5] {
                for stride in [1, 2] {
                    let g = Window { h, w, k, stride };
                    let (oh, ow) = g.out();
                    let c = 3;
                    let x: Vec<f32> = (0..c * h * w).map(|_| next() * 8.0).collect();
                    let taps: Vec<f32> = (0..c * k * k).map(|_| next()).collect();
                    let b: Vec<f32> = (0..c).map(|_| next()).collect();
                    let mut got = vec![f32::NAN; c * oh * ow];
                    depthwise(&mut got, &x, &taps, &b, g, Act::Relu6);
                    for ch in 0..c {
                        let want = reference(
                            &x[ch * h * w..(ch + 1) * h * w],
                            &taps[ch * k * k..(ch + 1) * k * k],
                            b[ch],
                            g,
                        );
                        let got = &got[ch * oh * ow..(ch + 1) * oh * ow];
                        for (i, (a, e)) in got.iter().zip(&want).enumerate() {
                            assert!(
                                (a - e).abs() <= 1e-5 * (1.0 + e.abs()),
                                "{g:?} channel {ch} output {i}: {a} != {e}"
                            );
                        }
                    }
                }
            }
        }
    }
}
