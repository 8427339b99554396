//! SPDK backend (cargo feature `spdk`): the store's blocks on an SPDK bdev — an NVMe
//! controller driven by SPDK's user-space driver over PCIe or NVMe-oF/TCP, or a
//! malloc bdev — through SPDK's bdev layer.
//!
//! One OS thread is SPDK's: it initialises SPDK's environment (for a PCIe controller
//! on hugepages with IOVA = physical addresses, which a controller bound to
//! `uio_pci_generic` — no IOMMU — needs; otherwise without hugepages: `--no-huge`,
//! memory from the heap), its thread library, the bdev subsystem and a JSON
//! configuration that creates or attaches the bdev, then polls. The node's async
//! code hands it commands over a channel; the thread copies each write into a buffer
//! from `spdk_dma_malloc` (DMA-able for the PCIe driver), submits it, polls until
//! the completion callback runs, copies a read back into the caller's [`DmaBuf`] and
//! completes the caller's oneshot. A flush waits for every earlier command, as on
//! the other backends. SPDK's environment is initialised once per process: one SPDK
//! device per process.

use std::ffi::{CString, c_int, c_void};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::Duration;

use async_trait::async_trait;
use csd_spdk_sys as sys;
use tokio::sync::oneshot;

use super::block::{BlockDevice, DEFAULT_BLOCK_SIZE, DeviceCounters, DmaBuf, check_command};
use super::mailbox::Mailbox;
use crate::error::{Error, Result};
use csd_protocol::stats::{DeviceStats, Geometry};

/// What the bdev is.
#[derive(Debug, Clone, PartialEq)]
pub enum SpdkTarget {
    /// A bdev in memory of this many MiB (tests, and SPDK's own NVMe-oF targets).
    Malloc {
        /// Size in MiB.
        mib: u64,
    },
    /// An NVMe-oF/TCP controller: its namespace 1.
    Tcp {
        /// `HOST:PORT`.
        addr: String,
        /// The subsystem's NQN.
        nqn: String,
    },
    /// A file through SPDK's libaio bdev (the same file the io_uring backend can
    /// open: the two compared on one backing).
    Aio {
        /// The file.
        path: String,
    },
    /// A PCIe NVMe controller by its address (`0000:00:04.0`), bound to
    /// `uio_pci_generic` or `vfio-pci`: its namespace 1.
    Pcie {
        /// PCI address.
        bdf: String,
    },
}

impl SpdkTarget {
    /// Parses what follows `spdk:`: `malloc=MIB`, `tcp=HOST:PORT/NQN`, `pcie=BDF`,
    /// `aio=PATH`.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::InvalidArgument(format!(
                "device spec \"spdk:{s}\": {why} (expected spdk:malloc=MIB, spdk:tcp=HOST:PORT/NQN, spdk:pcie=BDF or spdk:aio=PATH)"
            ))
        };
        let (k, v) = s.split_once('=').ok_or_else(|| bad("no key=value"))?;
        match k {
            "malloc" => Ok(SpdkTarget::Malloc {
                mib: v
                    .parse()
                    .ok()
                    .filter(|&m| m > 0)
                    .ok_or_else(|| bad("the size is not a positive number of MiB"))?,
            }),
            "tcp" => {
                let (addr, nqn) = v.split_once('/').ok_or_else(|| bad("no /NQN"))?;
                if !addr.contains(':') || nqn.is_empty() {
                    return Err(bad("expected HOST:PORT/NQN"));
                }
                Ok(SpdkTarget::Tcp {
                    addr: addr.into(),
                    nqn: nqn.into(),
                })
            }
            "pcie" if !v.is_empty() => Ok(SpdkTarget::Pcie { bdf: v.into() }),
            "aio" if !v.is_empty() && !v.contains('"') => Ok(SpdkTarget::Aio { path: v.into() }),
            _ => Err(bad("unknown target")),
        }
    }

    /// The bdev subsystem's JSON configuration, and the bdev's name.
    fn config(&self) -> (String, String) {
        let (method, bdev) = match self {
            SpdkTarget::Malloc { mib } => (
                format!(
                    r#"{{"method":"bdev_malloc_create","params":{{"name":"csd0","num_blocks":{},"block_size":512}}}}"#,
                    mib << 11
                ),
                "csd0",
            ),
            SpdkTarget::Tcp { addr, nqn } => {
                let (host, port) = addr.rsplit_once(':').unwrap_or((addr, "4420"));
                (
                    format!(
                        r#"{{"method":"bdev_nvme_attach_controller","params":{{"name":"csd","trtype":"tcp","adrfam":"ipv4","traddr":"{host}","trsvcid":"{port}","subnqn":"{nqn}"}}}}"#
                    ),
                    "csdn1",
                )
            }
            SpdkTarget::Pcie { bdf } => (
                format!(
                    r#"{{"method":"bdev_nvme_attach_controller","params":{{"name":"csd","trtype":"pcie","traddr":"{bdf}"}}}}"#
                ),
                "csdn1",
            ),
            SpdkTarget::Aio { path } => (
                format!(
                    r#"{{"method":"bdev_aio_create","params":{{"name":"csd0","filename":"{path}","block_size":4096}}}}"#
                ),
                "csd0",
            ),
        };
        (
            format!(
                r#"{{"subsystems":[{{"subsystem":"bdev","config":[{method},{{"method":"bdev_wait_for_examine"}}]}}]}}"#
            ),
            bdev.into(),
        )
    }
}

impl std::fmt::Display for SpdkTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpdkTarget::Malloc { mib } => write!(f, "malloc={mib}"),
            SpdkTarget::Tcp { addr, nqn } => write!(f, "tcp={addr}/{nqn}"),
            SpdkTarget::Pcie { bdf } => write!(f, "pcie={bdf}"),
            SpdkTarget::Aio { path } => write!(f, "aio={path}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Read,
    Write,
    Flush,
    Unmap,
}

struct Command {
    op: Op,
    /// In the bdev's blocks.
    offset: u64,
    blocks: u64,
    buf: Option<DmaBuf>,
    done: oneshot::Sender<(std::result::Result<(), String>, Option<DmaBuf>)>,
}

/// What the SPDK thread found at open.
struct Opened {
    bdev_block: u32,
    bdev_blocks: u64,
    unmap: bool,
}

/// An SPDK bdev as a [`BlockDevice`].
pub struct SpdkDevice {
    geometry: Geometry,
    /// Bdev blocks per store block.
    per_block: u64,
    unmap: bool,
    mailbox: Mailbox<Command>,
    thread: Option<std::thread::JoinHandle<()>>,
    counters: DeviceCounters,
}

static STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Memory SPDK's environment takes without hugepages (no PCIe device), MiB (its
/// buffer pools).
const SPDK_MEM_MB: c_int = 1024;

impl SpdkDevice {
    /// Starts SPDK on its own thread and opens `target`'s bdev.
    pub fn open(target: &SpdkTarget, queue_depth: usize) -> Result<Self> {
        if STARTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return Err(Error::Unavailable(
                "SPDK's environment is initialised once per process: one spdk: device per node process".into(),
            ));
        }
        if let Err(why) = SPDK.get_or_init(sys::load) {
            return Err(Error::Unavailable(format!("SPDK device {target}: {why}")));
        }
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = target.clone();
        let thread = std::thread::Builder::new()
            .name("csd-spdk".into())
            .spawn(move || spdk_thread(t, ready_tx, rx))
            .map_err(|e| Error::io("starting the SPDK thread", e))?;
        let opened = ready_rx
            .recv()
            .map_err(|_| Error::Internal("the SPDK thread stopped while starting".into()))?
            .map_err(|why| Error::Unavailable(format!("SPDK device {target}: {why}")))?;
        let bs = opened.bdev_block as usize;
        if bs == 0 || bs > DEFAULT_BLOCK_SIZE || !DEFAULT_BLOCK_SIZE.is_multiple_of(bs) {
            return Err(Error::Unimplemented(format!(
                "SPDK device {target} has {bs}-byte blocks: csd needs blocks dividing {DEFAULT_BLOCK_SIZE}"
            )));
        }
        let per_block = (DEFAULT_BLOCK_SIZE / bs) as u64;
        let name = format!("spdk:{target}");
        Ok(SpdkDevice {
            geometry: Geometry {
                name: name.clone(),
                block_size: DEFAULT_BLOCK_SIZE,
                num_blocks: opened.bdev_blocks / per_block,
                queue_depth,
            },
            per_block,
            unmap: opened.unmap,
            mailbox: Mailbox::new(name, "the SPDK thread", queue_depth, tx),
            thread: Some(thread),
            counters: DeviceCounters::default(),
        })
    }

    async fn submit(
        &self,
        op: Op,
        lba: u64,
        blocks: u64,
        buf: Option<DmaBuf>,
    ) -> Result<Option<DmaBuf>> {
        let per_block = self.per_block;
        let (res, buf) = self
            .mailbox
            .call(
                |done| Command {
                    op,
                    offset: lba * per_block,
                    blocks: blocks * per_block,
                    buf,
                    done,
                },
                || {},
            )
            .await?;
        res.map_err(|why| {
            Error::io(
                format!(
                    "{op:?} of blocks [{lba}, {}) on {}",
                    lba + blocks,
                    self.geometry.name
                ),
                std::io::Error::other(why),
            )
        })?;
        Ok(buf)
    }

    /// A read or write of `buf` at `lba` (checked), its buffer handed back.
    async fn rw(&self, op: Op, what: &str, lba: u64, buf: DmaBuf) -> Result<DmaBuf> {
        let blocks = check_command(&self.geometry, what, lba, &buf)?;
        self.submit(op, lba, blocks, Some(buf))
            .await?
            .ok_or_else(|| Error::Internal(format!("an SPDK {what} lost its buffer")))
    }
}

#[async_trait]
impl BlockDevice for SpdkDevice {
    fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    async fn read(&self, lba: u64, buf: DmaBuf) -> Result<DmaBuf> {
        let len = buf.len();
        let buf = self.rw(Op::Read, "read", lba, buf).await?;
        self.counters.record_read(len);
        Ok(buf)
    }

    async fn write(&self, lba: u64, buf: DmaBuf) -> Result<DmaBuf> {
        let len = buf.len();
        let buf = self.rw(Op::Write, "write", lba, buf).await?;
        self.counters.record_write(len);
        Ok(buf)
    }

    async fn flush(&self) -> Result<()> {
        self.submit(Op::Flush, 0, self.geometry.num_blocks, None)
            .await?;
        self.counters.record_flush();
        Ok(())
    }

    fn stats(&self) -> DeviceStats {
        self.counters.snapshot()
    }

    fn can_deallocate(&self) -> bool {
        self.unmap
    }

    async fn deallocate(&self, lba: u64, blocks: u64) -> Result<()> {
        if !self.unmap || blocks == 0 {
            return Ok(());
        }
        self.submit(Op::Unmap, lba, blocks, None).await?;
        self.counters
            .record_deallocate(blocks * DEFAULT_BLOCK_SIZE as u64);
        Ok(())
    }
}

impl Drop for SpdkDevice {
    fn drop(&mut self) {
        self.mailbox.close();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A command on the bdev, passed through SPDK as its callback argument.
struct InFlight {
    cmd: Command,
    dma: *mut c_void,
    len: usize,
    outstanding: *mut usize,
}

unsafe extern "C" fn io_done(io: *mut sys::spdk_bdev_io, success: bool, arg: *mut c_void) {
    // SAFETY: SPDK hands back the bdev_io it gave us and the argument we passed: a
    // Box<InFlight> leaked at submission, taken back exactly once here.
    unsafe {
        lib().spdk_bdev_free_io(io);
        let f = Box::from_raw(arg as *mut InFlight);
        *f.outstanding -= 1;
        finish(*f, success);
    }
}

/// Completes a command: copies a read's bytes out, frees the DMA buffer.
unsafe fn finish(f: InFlight, success: bool) {
    let InFlight { cmd, dma, len, .. } = f;
    let Command {
        op, mut buf, done, ..
    } = cmd;
    if !dma.is_null() {
        if success
            && op == Op::Read
            && let Some(b) = buf.as_mut()
        {
            // SAFETY: dma holds `len` bytes SPDK just read; b is at least that long.
            unsafe { std::ptr::copy_nonoverlapping(dma as *const u8, b.as_mut_ptr(), len) };
        }
        // SAFETY: dma came from dma_take and nothing refers to it any more.
        unsafe { dma_give(len, dma) };
    }
    let res = if success {
        Ok(())
    } else {
        Err(format!("the bdev failed the {op:?}"))
    };
    let _ = done.send((res, buf));
}

unsafe extern "C" fn init_done(rc: c_int, arg: *mut c_void) {
    // SAFETY: arg is the Option<c_int> the SPDK thread polls on.
    unsafe { *(arg as *mut Option<c_int>) = Some(rc) };
}

unsafe extern "C" fn fini_done(arg: *mut c_void) {
    // SAFETY: arg is the bool the SPDK thread polls on.
    unsafe { *(arg as *mut bool) = true };
}

unsafe extern "C" fn bdev_event(
    _kind: sys::spdk_bdev_event_type,
    _bdev: *mut sys::spdk_bdev,
    _ctx: *mut c_void,
) {
    // Removal or resize: the node keeps its descriptor until it stops; I/O to a
    // removed bdev fails and is reported as such.
}

/// Polls `thread` until `done` says so.
unsafe fn poll_until(thread: *mut sys::spdk_thread, done: impl Fn() -> bool) {
    while !done() {
        // SAFETY: the thread is ours and current.
        unsafe { lib().spdk_thread_poll(thread, 0, 0) };
    }
}

/// SPDK's functions, loaded once per process.
static SPDK: std::sync::OnceLock<std::result::Result<sys::Spdk, String>> =
    std::sync::OnceLock::new();

/// SPDK's functions (loaded by [`SpdkDevice::open`] before any call).
fn lib() -> &'static sys::Spdk {
    match SPDK.get() {
        Some(Ok(l)) => l,
        _ => unreachable!("SPDK is loaded before its thread starts"),
    }
}

/// The SPDK thread: starts SPDK, opens the bdev, serves commands, stops SPDK.
fn spdk_thread(
    target: SpdkTarget,
    ready: Sender<std::result::Result<Opened, String>>,
    rx: Receiver<Command>,
) {
    // SAFETY: every SPDK call below runs on this one thread, in SPDK's documented
    // order (env, thread library, subsystems, bdev), with pointers that outlive them.
    unsafe {
        let name = c"csd";
        let mut eo: sys::spdk_env_opts = std::mem::zeroed();
        eo.opts_size = std::mem::size_of::<sys::spdk_env_opts>();
        lib().spdk_env_opts_init(&mut eo);
        eo.name = name.as_ptr();
        let pcie = matches!(target, SpdkTarget::Pcie { .. });
        if pcie {
            // A controller bound to uio_pci_generic (no IOMMU) DMAs to physical
            // addresses, which DPDK knows only for hugepage memory: without hugepages
            // SPDK forces IOVA = VA and DPDK's PCI bus skips the device.
            eo.no_huge = false;
            eo.mem_size = -1;
            eo.iova_mode = c"pa".as_ptr();
        } else {
            eo.no_huge = true;
            eo.mem_size = SPDK_MEM_MB;
        }
        eo.no_pci = !pcie;
        if lib().spdk_env_init(&eo) != 0 {
            let _ = ready.send(Err(
                "spdk_env_init failed (see SPDK's messages above; a PCIe device must be bound to uio_pci_generic, with 2 MiB hugepages reserved and hugetlbfs mounted)".into(),
            ));
            return;
        }
        lib().spdk_unaffinitize_thread();
        lib().spdk_thread_lib_init(None, 0);
        let thread = lib().spdk_thread_create(name.as_ptr(), std::ptr::null());
        lib().spdk_set_thread(thread);
        let mut rc: Option<c_int> = None;
        lib().spdk_subsystem_init(Some(init_done), &mut rc as *mut _ as *mut c_void);
        poll_until(thread, || std::ptr::read_volatile(&rc).is_some());
        if rc != Some(0) {
            let _ = ready.send(Err(format!("SPDK's subsystems failed to start ({rc:?})")));
            return;
        }
        lib().spdk_rpc_set_state(sys::SPDK_RPC_RUNTIME);
        let (json, bdev_name) = target.config();
        let mut json = json.into_bytes();
        let len = json.len() as isize;
        let mut rc: Option<c_int> = None;
        lib().spdk_subsystem_load_config(
            json.as_mut_ptr() as *mut c_void,
            len,
            Some(init_done),
            &mut rc as *mut _ as *mut c_void,
            true,
        );
        poll_until(thread, || std::ptr::read_volatile(&rc).is_some());
        let bdev_c = CString::new(bdev_name.clone()).unwrap_or_default();
        let mut desc: *mut sys::spdk_bdev_desc = std::ptr::null_mut();
        if rc != Some(0)
            || lib().spdk_bdev_open_ext(
                bdev_c.as_ptr(),
                true,
                Some(bdev_event),
                std::ptr::null_mut(),
                &mut desc,
            ) != 0
        {
            let _ = ready.send(Err(format!(
                "the bdev {bdev_name} could not be created or opened (configuration {rc:?}; is the target reachable?)"
            )));
            stop(thread, std::ptr::null_mut(), std::ptr::null_mut());
            return;
        }
        let bdev = lib().spdk_bdev_desc_get_bdev(desc);
        let ch = lib().spdk_bdev_get_io_channel(desc);
        let align = lib().spdk_bdev_get_buf_align(bdev).max(DEFAULT_BLOCK_SIZE);
        let bdev_block = lib().spdk_bdev_get_block_size(bdev);
        let _ = ready.send(Ok(Opened {
            bdev_block,
            bdev_blocks: lib().spdk_bdev_get_num_blocks(bdev),
            unmap: lib()
                .spdk_bdev_io_type_supported(bdev, sys::spdk_bdev_io_type_SPDK_BDEV_IO_TYPE_UNMAP),
        }));
        serve(thread, desc, ch, align, bdev_block as usize, &rx);
        stop(thread, desc, ch);
    }
}

/// Serves commands until the channel closes and nothing is in flight.
unsafe fn serve(
    thread: *mut sys::spdk_thread,
    desc: *mut sys::spdk_bdev_desc,
    ch: *mut sys::spdk_io_channel,
    align: usize,
    block: usize,
    rx: &Receiver<Command>,
) {
    let mut outstanding: usize = 0;
    let mut waiting: std::collections::VecDeque<Command> = Default::default();
    let mut closed = false;
    loop {
        // A flush waits at the head until everything before it has completed.
        while let Some(cmd) = waiting.pop_front() {
            if cmd.op == Op::Flush && outstanding > 0 {
                waiting.push_front(cmd);
                break;
            }
            // SAFETY: on the SPDK thread, with the open descriptor and channel.
            match unsafe { start(desc, ch, align, block, cmd, &mut outstanding) } {
                Ok(()) => {}
                // The bdev is out of request objects: try again after polling.
                Err(cmd) => {
                    waiting.push_front(cmd);
                    break;
                }
            }
        }
        if !closed {
            loop {
                match rx.try_recv() {
                    Ok(cmd) => waiting.push_back(cmd),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        closed = true;
                        break;
                    }
                }
            }
        }
        // SAFETY: our thread, current.
        let worked = unsafe { lib().spdk_thread_poll(thread, 0, 0) };
        if closed && outstanding == 0 && waiting.is_empty() {
            return;
        }
        if worked == 0 && outstanding == 0 && waiting.is_empty() && !closed {
            // Idle: wait a little for the next command (SPDK's own pollers, such as
            // an NVMe-oF controller's keep-alive, run at least every millisecond).
            match rx.recv_timeout(Duration::from_millis(1)) {
                Ok(cmd) => waiting.push_back(cmd),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => closed = true,
            }
        }
    }
}

/// DMA buffers given back, by length, for the next command of that length: each
/// allocation from SPDK's hugepage heap and each free cost the SPDK thread more than
/// the command (1 MiB reads at queue depth 8 ran at 1.5 ms each against 1.0 ms one
/// at a time, in a QEMU guest).
const DMA_POOL: usize = 64;

thread_local! {
    static POOL: std::cell::RefCell<Vec<(usize, *mut c_void)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A DMA-able buffer of `len` bytes (`align`ed), from the pool or SPDK (null when
/// SPDK has no memory). Not zeroed: a read fills it, a write's bytes are copied in.
unsafe fn dma_take(len: usize, align: usize) -> *mut c_void {
    let pooled = POOL.with(|p| {
        let mut p = p.borrow_mut();
        let i = p.iter().position(|(l, _)| *l == len)?;
        Some(p.swap_remove(i).1)
    });
    match pooled {
        Some(b) => b,
        // SAFETY: a plain allocation, on the SPDK thread.
        None => unsafe { lib().spdk_dma_malloc(len, align, std::ptr::null_mut()) },
    }
}

/// Gives back a buffer from [`dma_take`].
unsafe fn dma_give(len: usize, b: *mut c_void) {
    let kept = POOL.with(|p| {
        let mut p = p.borrow_mut();
        (p.len() < DMA_POOL).then(|| p.push((len, b))).is_some()
    });
    if !kept {
        // SAFETY: from spdk_dma_malloc, referred to by nothing.
        unsafe { lib().spdk_dma_free(b) };
    }
}

/// Frees the pooled buffers (before SPDK's environment stops).
unsafe fn dma_drain() {
    for (_, b) in POOL.with(|p| std::mem::take(&mut *p.borrow_mut())) {
        // SAFETY: from spdk_dma_malloc, referred to by nothing.
        unsafe { lib().spdk_dma_free(b) };
    }
}

/// Submits one command; hands it back when the bdev is out of request objects.
unsafe fn start(
    desc: *mut sys::spdk_bdev_desc,
    ch: *mut sys::spdk_io_channel,
    align: usize,
    block: usize,
    cmd: Command,
    outstanding: &mut usize,
) -> std::result::Result<(), Command> {
    let len = cmd.blocks as usize * block;
    let dma = if matches!(cmd.op, Op::Read | Op::Write) {
        // SAFETY: a plain allocation; given back in `finish`.
        let p = unsafe { dma_take(len, align) };
        if p.is_null() {
            return Err(cmd);
        }
        if cmd.op == Op::Write
            && let Some(b) = cmd.buf.as_ref()
        {
            // SAFETY: p holds len bytes; the write's buffer is len bytes.
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), p as *mut u8, len) };
        }
        p
    } else {
        std::ptr::null_mut()
    };
    let (op, offset, blocks) = (cmd.op, cmd.offset, cmd.blocks);
    let f = Box::into_raw(Box::new(InFlight {
        cmd,
        dma,
        len,
        outstanding: outstanding as *mut usize,
    }));
    let arg = f as *mut c_void;
    // SAFETY: desc/ch are open on this thread; dma holds `blocks` blocks; `arg`
    // comes back to io_done exactly once when the call returns 0.
    let rc = unsafe {
        match op {
            Op::Read => {
                lib().spdk_bdev_read_blocks(desc, ch, dma, offset, blocks, Some(io_done), arg)
            }
            Op::Write => {
                lib().spdk_bdev_write_blocks(desc, ch, dma, offset, blocks, Some(io_done), arg)
            }
            Op::Flush => lib().spdk_bdev_flush_blocks(desc, ch, 0, blocks, Some(io_done), arg),
            Op::Unmap => lib().spdk_bdev_unmap_blocks(desc, ch, offset, blocks, Some(io_done), arg),
        }
    };
    // SAFETY: f is ours again unless SPDK took it (rc == 0).
    let f = unsafe { Box::from_raw(f) };
    if rc == 0 {
        *outstanding += 1;
        std::mem::forget(f);
        return Ok(());
    }
    if !dma.is_null() {
        // SAFETY: taken above, not handed to SPDK.
        unsafe { dma_give(len, dma) };
    }
    let Command { done, buf, .. } = match *f {
        InFlight { cmd, .. } if rc == -libc::ENOMEM => return Err(cmd),
        InFlight { cmd, .. } => cmd,
    };
    let _ = done.send((
        Err(format!(
            "the bdev refused the {op:?} ({})",
            std::io::Error::from_raw_os_error(-rc)
        )),
        buf,
    ));
    Ok(())
}

/// Releases the bdev and stops SPDK.
unsafe fn stop(
    thread: *mut sys::spdk_thread,
    desc: *mut sys::spdk_bdev_desc,
    ch: *mut sys::spdk_io_channel,
) {
    // SAFETY: our thread, current; the channel and descriptor are ours.
    unsafe {
        if !ch.is_null() {
            lib().spdk_put_io_channel(ch);
        }
        if !desc.is_null() {
            lib().spdk_bdev_close(desc);
        }
        let mut done = false;
        lib().spdk_subsystem_fini(Some(fini_done), &mut done as *mut bool as *mut c_void);
        poll_until(thread, || std::ptr::read_volatile(&done));
        lib().spdk_thread_exit(thread);
        while !lib().spdk_thread_is_exited(thread) {
            lib().spdk_thread_poll(thread, 0, 0);
        }
        lib().spdk_thread_destroy(thread);
        dma_drain();
        lib().spdk_thread_lib_fini();
        lib().spdk_env_fini();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        assert_eq!(
            SpdkTarget::parse("malloc=64").unwrap(),
            SpdkTarget::Malloc { mib: 64 }
        );
        assert_eq!(
            SpdkTarget::parse("tcp=127.0.0.1:4420/nqn.2016-06.io.spdk:cnode1").unwrap(),
            SpdkTarget::Tcp {
                addr: "127.0.0.1:4420".into(),
                nqn: "nqn.2016-06.io.spdk:cnode1".into()
            }
        );
        assert_eq!(
            SpdkTarget::parse("aio=/data/x.img").unwrap().config().1,
            "csd0"
        );
        for bad in [
            "malloc=0",
            "tcp=host/nqn",
            "tcp=h:1",
            "disk=1",
            "pcie=",
            "aio=",
            "aio=a\"b",
        ] {
            assert!(SpdkTarget::parse(bad).is_err(), "{bad}");
        }
        let (json, bdev) = SpdkTarget::parse("malloc=2").unwrap().config();
        assert_eq!(bdev, "csd0");
        assert!(json.contains(r#""num_blocks":4096"#), "{json}");
    }
}
