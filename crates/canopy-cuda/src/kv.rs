//! KV in device memory: [`CudaKv`] holds K and V, contiguous or paged (a pool of fixed-size
//! pages behind a page table), and the backend's copies in and out of it map logical tokens
//! to physical byte ranges ([`CudaBackend::segments`]). Also the on-device random fill.

use crate::backend::CudaBackend;
use crate::error::{CudaError, DriverContext, Result};
use crate::layers::narrow;
use canopy_core::{AttnShape, DType};
use canopy_kernels::Kernel;
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// Device KV: K and V bytes and, when paged, the page table.
pub struct CudaKv {
    pub(crate) shape: AttnShape,
    pub(crate) dtype: DType,
    pub(crate) tokens: usize,
    pub(crate) k: CudaSlice<u8>,
    pub(crate) v: CudaSlice<u8>,
    pub(crate) paging: Option<Paging>,
}

impl CudaKv {
    /// Bytes of K (or V) of the first `tokens` tokens of contiguous storage.
    pub(crate) fn bytes_of(&self, tokens: usize) -> usize {
        tokens * self.shape.kv_token_bytes(self.dtype)
    }

    /// Physical token slots of the pool (a paged pool's pages, whatever its page table says).
    pub(crate) fn pool_tokens(&self) -> usize {
        self.k.len() / self.bytes_of(1).max(1)
    }

    /// Physical pages of a paged pool (none for contiguous storage).
    pub(crate) fn pool_pages(&self) -> usize {
        self.paging
            .as_ref()
            .map_or(0, |p| self.pool_tokens() >> p.shift)
    }

    /// Refuses, naming `op`, a slot past the pool: kernels index the pool by these slots.
    pub(crate) fn check_slots(&self, op: &str, slots: &[u32]) -> Result<()> {
        let pool = self.pool_tokens();
        match slots.iter().find(|&&slot| slot as usize >= pool) {
            Some(slot) => Err(CudaError::Unsupported(format!(
                "{op}: slot {slot} is outside the KV pool of {pool} tokens"
            ))),
            None => Ok(()),
        }
    }
}

pub(crate) struct Paging {
    pub(crate) shift: u32,
    /// Logical page → physical page, on the host (for copies) and on the device (for kernels).
    /// The layers of a model share one device table ([`CudaBackend::set_page_tables`]).
    pub(crate) host: Vec<u32>,
    pub(crate) device: Arc<CudaSlice<u32>>,
}

impl CudaBackend {
    /// Fills tokens `dst..dst + count` of `kv` with the hashed random values of global tokens
    /// `first_token..` (see `canopy_core::data`), on the device: a rank fills its shard of a
    /// tensor that the f64 oracle regenerates whole on the CPU.
    pub fn fill_random(
        &self,
        kv: &mut CudaKv,
        dst: usize,
        count: usize,
        seed: u64,
        first_token: u64,
    ) -> Result<()> {
        // Paged KV is filled by physical slot (the pool), whatever the page table says.
        let slots = kv.k.len() / kv.bytes_of(1);
        if dst + count > slots {
            return Err(CudaError::Unsupported(format!(
                "random fill of slots {dst}..{} past the {slots} allocated",
                dst + count
            )));
        }
        let f = self.function(Kernel::Fill(kv.dtype))?;
        let per = kv.shape.kv_token_elems();
        let bytes = kv.bytes_of(1);
        let n = (count * per) as u64;
        let first = first_token * per as u64;
        let amp = canopy_core::data::KV_AMPLITUDE;
        let cfg = LaunchConfig {
            grid_dim: (self.gpu.multiprocessors * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        for (buf, stream_id) in [
            (&mut kv.k, canopy_core::data::STREAM_K),
            (&mut kv.v, canopy_core::data::STREAM_V),
        ] {
            let mut view = buf.slice_mut(dst * bytes..(dst + count) * bytes);
            let mut b = self.stream.launch_builder(&f);
            b.arg(&mut view)
                .arg(&n)
                .arg(&first)
                .arg(&seed)
                .arg(&stream_id)
                .arg(&amp);
            // SAFETY: the kernel writes n elements of the dtype into a view of that size.
            unsafe { b.launch(cfg) }.ctx("launching fill_random")?;
        }
        Ok(())
    }

    /// Installs a page table (logical page → physical page) on paged KV: a growing tree's
    /// snapshot maps its logical pages onto the pool's shared physical pages this way. The
    /// table is written in place, where recorded decode passes read it, while it fits; a
    /// longer one (logical room reserved past the pool's size) gets a larger buffer.
    pub fn set_page_table(&self, kv: &mut CudaKv, table: &[u32]) -> Result<()> {
        check_table(kv, table.iter().copied().max())?;
        let words = table_room(kv.pool_pages(), table);
        let p = kv.paging.as_mut().expect("checked above");
        // A table shared with other KV is left to them.
        if Arc::get_mut(&mut p.device).is_none() {
            self.renew("a page table")?;
            p.device = Arc::new(self.alloc::<u32>(words)?);
        }
        let device = Arc::get_mut(&mut p.device).expect("unshared above");
        self.write_or_grow(table, device, "a page table")?;
        keep_on_host(p, table);
        Ok(())
    }

    /// [`CudaBackend::set_page_table`] of one `table` on every KV of `kvs` (a model's layers,
    /// whose pages lie alike), which then share one device table: a step that adds pages
    /// copies its table to the device once, not once a layer. The shared table is written in
    /// place while it fits, where recorded decode passes read it.
    pub fn set_page_tables(&self, kvs: &mut [CudaKv], table: &[u32]) -> Result<()> {
        self.refuse_while_capturing("a page table")?;
        let Some(first) = kvs.first() else {
            return Ok(());
        };
        let highest = table.iter().copied().max();
        for kv in kvs.iter() {
            check_table(kv, highest)?;
        }
        let shared = Arc::clone(&first.paging.as_ref().expect("checked above").device);
        let all_share = kvs.iter().all(|kv| {
            let p = kv.paging.as_ref().expect("checked above");
            Arc::ptr_eq(&p.device, &shared)
        });
        let device = match all_share && shared.len() >= table.len() {
            true => shared,
            false => {
                self.renew("a page table")?;
                let words = table_room(first.pool_pages(), table);
                let fresh = Arc::new(self.alloc::<u32>(words)?);
                for kv in kvs.iter_mut() {
                    kv.paging.as_mut().expect("checked above").device = Arc::clone(&fresh);
                }
                fresh
            }
        };
        if !table.is_empty() {
            let (dst, _written) = device.device_ptr(&self.stream);
            self.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
            // SAFETY: the table holds at least table.len() words (checked or allocated
            // above), and this backend's one stream orders the copy before every kernel that
            // reads the table and after those that read it before.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(dst, table, self.stream.cu_stream())
            }
            .ctx("cuMemcpyHtoDAsync")?;
        }
        for kv in kvs.iter_mut() {
            keep_on_host(kv.paging.as_mut().expect("checked above"), table);
        }
        Ok(())
    }

    /// Physical byte ranges holding logical tokens `start..start + n`, in logical order, each
    /// with its byte offset among them; consecutive pages merge into one range.
    pub(crate) fn segments(
        kv: &CudaKv,
        start: usize,
        n: usize,
    ) -> Vec<(usize, std::ops::Range<usize>)> {
        let tb = kv.bytes_of(1);
        match &kv.paging {
            None => vec![(0, start * tb..(start + n) * tb)],
            Some(p) => {
                let size = 1usize << p.shift;
                let mut out: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
                let (mut t, end) = (start, start + n);
                while t < end {
                    let (page, within) = (t >> p.shift, t & (size - 1));
                    let take = (size - within).min(end - t);
                    let phys = p.host[page] as usize * size + within;
                    let bytes = phys * tb..(phys + take) * tb;
                    // Pages that follow each other in the pool travel as one copy.
                    match out.last_mut() {
                        Some((_, last)) if last.end == bytes.start => last.end = bytes.end,
                        _ => out.push(((t - start) * tb, bytes)),
                    }
                    t += take;
                }
                out
            }
        }
    }

    pub(crate) fn write_bytes(
        &self,
        kv: &mut CudaKv,
        start: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<()> {
        let n = k.len() / kv.bytes_of(1);
        for (host_at, dev) in Self::segments(kv, start, n) {
            let len = dev.len();
            self.stream
                .memcpy_htod(&k[host_at..host_at + len], &mut kv.k.slice_mut(dev.clone()))
                .ctx("cuMemcpyHtoD")?;
            self.stream
                .memcpy_htod(&v[host_at..host_at + len], &mut kv.v.slice_mut(dev))
                .ctx("cuMemcpyHtoD")?;
        }
        Ok(())
    }

    pub(crate) fn read_bytes(&self, kv: &CudaKv, n: usize) -> Result<(Vec<u8>, Vec<u8>)> {
        let bytes = kv.bytes_of(n);
        let (mut k, mut v) = (vec![0u8; bytes], vec![0u8; bytes]);
        for (host_at, dev) in Self::segments(kv, 0, n) {
            let len = dev.len();
            self.stream
                .memcpy_dtoh(&kv.k.slice(dev.clone()), &mut k[host_at..host_at + len])
                .ctx("cuMemcpyDtoH")?;
            self.stream
                .memcpy_dtoh(&kv.v.slice(dev), &mut v[host_at..host_at + len])
                .ctx("cuMemcpyDtoH")?;
        }
        self.stream.synchronize().ctx("cuStreamSynchronize")?;
        Ok((k, v))
    }
}

/// Device-to-device copies of logical tokens, for transports that move KV without the host
/// (`crate::device_world`): the same page-table walk as [`CudaBackend::read_bytes`] and
/// [`CudaBackend::write_bytes`], on this backend's stream. Neither waits for the stream.
impl CudaBackend {
    /// Refuses logical tokens `start..start + n` past what `kv` holds (a page table walk past
    /// the pool would index out of it).
    pub(crate) fn check_tokens(op: &str, kv: &CudaKv, start: usize, n: usize) -> Result<()> {
        if start + n > kv.tokens {
            return Err(CudaError::Unsupported(format!(
                "{op}: logical tokens {start}..{} of KV that holds {}; size the receiving KV for the largest shard",
                start + n,
                kv.tokens
            )));
        }
        Ok(())
    }

    /// Copies logical tokens `start..start + n` of paged `kv` from (`scatter`) or to the
    /// contiguous `flat` K and V, a launch of `copy_pages` each: one block per page where a
    /// page-by-page copy would be thousands of small copies. Returns `false`, copying
    /// nothing, where the kernel does not apply (contiguous KV, a start inside a page, pages
    /// that are not whole 16-byte words): the caller copies by segment.
    fn copy_pages(
        &self,
        kv: &CudaKv,
        start: usize,
        n: usize,
        flat: (&CudaView<u8>, &CudaView<u8>),
        scatter: bool,
    ) -> Result<bool> {
        let Some(paging) = &kv.paging else {
            return Ok(false);
        };
        let page_tokens = 1usize << paging.shift;
        let page_bytes = kv.bytes_of(page_tokens);
        if n == 0 || !start.is_multiple_of(page_tokens) || !page_bytes.is_multiple_of(16) {
            return Ok(false);
        }
        let bytes = kv.bytes_of(n);
        if flat.0.len() < bytes || flat.1.len() < bytes {
            return Err(CudaError::Unsupported(format!(
                "copy_pages: contiguous K of {} bytes and V of {} bytes for {n} tokens ({bytes} bytes)",
                flat.0.len(),
                flat.1.len()
            )));
        }
        let f = self.function(Kernel::CopyPages)?;
        let cfg = LaunchConfig {
            grid_dim: (narrow("copy_pages", n.div_ceil(page_tokens))?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (first_page, page_bytes, bytes) = (
            (start / page_tokens) as u64,
            page_bytes as u64,
            bytes as u64,
        );
        let scatter = u32::from(scatter);
        for (pool, flat) in [(&kv.k, flat.0), (&kv.v, flat.1)] {
            let mut b = self.stream.launch_builder(&f);
            b.arg(pool)
                .arg(flat)
                .arg(&*paging.device)
                .arg(&first_page)
                .arg(&page_bytes)
                .arg(&bytes)
                .arg(&scatter);
            // SAFETY: every page the grid touches is in the page table (tokens were checked
            // against the KV's) and inside the pool, and `flat` holds `bytes`; the kernel
            // writes one side only, the pool where `scatter`, else `flat`.
            unsafe { b.launch(cfg) }.ctx("launching copy_pages")?;
        }
        Ok(true)
    }

    /// K and V of logical tokens `0..n` of `kv`, gathered into fresh contiguous device buffers
    /// (in logical order) on this backend's stream.
    pub(crate) fn gather_device(
        &self,
        kv: &CudaKv,
        n: usize,
    ) -> Result<(CudaSlice<u8>, CudaSlice<u8>)> {
        Self::check_tokens("gather_device", kv, 0, n)?;
        let bytes = kv.bytes_of(n);
        let (mut k, mut v) = (self.alloc::<u8>(bytes)?, self.alloc::<u8>(bytes)?);
        self.gather_tokens(kv, 0..n, (&mut k, &mut v))?;
        Ok((k, v))
    }

    /// K and V of logical tokens `tokens` of `kv` into the same tokens' places of contiguous
    /// device buffers that hold logical order from token 0 (so a shard can be gathered piece
    /// by piece), on this backend's stream.
    pub(crate) fn gather_tokens(
        &self,
        kv: &CudaKv,
        tokens: std::ops::Range<usize>,
        (k, v): (&mut CudaSlice<u8>, &mut CudaSlice<u8>),
    ) -> Result<()> {
        let (start, n) = (tokens.start, tokens.len());
        Self::check_tokens("gather_tokens", kv, start, n)?;
        let (first, end) = (kv.bytes_of(start), kv.bytes_of(tokens.end));
        if k.len() < end || v.len() < end {
            return Err(CudaError::Unsupported(format!(
                "gather_tokens: K of {} bytes and V of {} bytes for tokens up to {} of {} bytes each",
                k.len(),
                v.len(),
                tokens.end,
                kv.bytes_of(1)
            )));
        }
        if self.copy_pages(
            kv,
            start,
            n,
            (&k.slice(first..end), &v.slice(first..end)),
            false,
        )? {
            return Ok(());
        }
        for (at, dev) in Self::segments(kv, start, n) {
            let (at, len) = (first + at, dev.len());
            if len == 0 {
                continue;
            }
            self.stream
                .memcpy_dtod(&kv.k.slice(dev.clone()), &mut k.slice_mut(at..at + len))
                .ctx("cuMemcpyDtoDAsync (gathering K)")?;
            self.stream
                .memcpy_dtod(&kv.v.slice(dev), &mut v.slice_mut(at..at + len))
                .ctx("cuMemcpyDtoDAsync (gathering V)")?;
        }
        Ok(())
    }

    /// Scatters `n` tokens of contiguous device K and V (logical order, as
    /// [`CudaBackend::gather_device`] gives them) into logical tokens `start..start + n` of
    /// `kv` through its page table, on this backend's stream.
    pub(crate) fn scatter_device(
        &self,
        kv: &mut CudaKv,
        start: usize,
        n: usize,
        k: &CudaSlice<u8>,
        v: &CudaSlice<u8>,
    ) -> Result<()> {
        let bytes = kv.bytes_of(n);
        if k.len() < bytes || v.len() < bytes {
            return Err(CudaError::Unsupported(format!(
                "scatter_device: K of {} bytes and V of {} bytes for {n} tokens of {} bytes each",
                k.len(),
                v.len(),
                kv.bytes_of(1)
            )));
        }
        Self::check_tokens("scatter_device", kv, start, n)?;
        if self.copy_pages(kv, start, n, (&k.slice(..), &v.slice(..)), true)? {
            return Ok(());
        }
        for (at, dev) in Self::segments(kv, start, n) {
            let len = dev.len();
            if len == 0 {
                continue;
            }
            self.stream
                .memcpy_dtod(&k.slice(at..at + len), &mut kv.k.slice_mut(dev.clone()))
                .ctx("cuMemcpyDtoDAsync (scattering K)")?;
            self.stream
                .memcpy_dtod(&v.slice(at..at + len), &mut kv.v.slice_mut(dev))
                .ctx("cuMemcpyDtoDAsync (scattering V)")?;
        }
        Ok(())
    }
}

/// Refuses a page table on KV that is not paged, or one whose `highest` page is past the pool.
fn check_table(kv: &CudaKv, highest: Option<u32>) -> Result<()> {
    if kv.paging.is_none() {
        return Err(CudaError::Unsupported(
            "page tables need paged KV (with_paging)".into(),
        ));
    }
    let pages = kv.pool_pages() as u32;
    match highest.filter(|&h| h >= pages) {
        Some(bad) => Err(CudaError::Unsupported(format!(
            "a page table names page {bad} of a pool of {pages} pages"
        ))),
        None => Ok(()),
    }
}

/// Words for a device page table made for `table` over a pool of `pool_pages` pages: room for
/// a table as long as the pool (the tables of a server's decode steps grow towards it as
/// requests join), so that growing tables are written in place, where recorded decode passes
/// read them, and a longer one's next power of two.
fn table_room(pool_pages: usize, table: &[u32]) -> usize {
    table.len().max(pool_pages).next_power_of_two()
}

/// `table` over the front of the host's copy of a page table.
fn keep_on_host(p: &mut Paging, table: &[u32]) {
    if table.len() > p.host.len() {
        p.host.resize(table.len(), 0);
    }
    p.host[..table.len()].copy_from_slice(table);
}

#[cfg(test)]
mod tests {
    use super::table_room;

    #[test]
    fn a_page_table_has_room_for_the_pool() {
        // A first small table gets the pool's length, so tables growing to it keep the buffer.
        assert_eq!(table_room(8192, &[0; 256]), 8192);
        assert_eq!(table_room(5000, &[0; 3]), 8192);
        // A table past the pool (logical room) gets its next power of two.
        assert_eq!(table_room(100, &[0; 300]), 512);
        assert_eq!(table_room(0, &[]), 1);
    }
}
