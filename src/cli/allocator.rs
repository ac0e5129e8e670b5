//! The global allocator: mimalloc, called the way it is fastest.
//!
//! The `mimalloc` crate sends every allocation through `mi_malloc_aligned`.
//! In mimalloc v3 that call only takes a page's free list while it holds
//! blocks; otherwise, for a block size that is not a power of two, it
//! over-allocates from the next size class instead of refilling the list
//! (purpleprotocol/mimalloc_rust#170). On tollgate's request path that was
//! eight of some thirty allocations per forwarded request. Plain
//! `mi_malloc` already returns what Rust asks for whenever the alignment is
//! at most 16 and no larger than the size: mimalloc's blocks above 8 bytes
//! are multiples of 16 from a 16-aligned page start, and smaller ones are
//! 8-byte blocks. Any other layout keeps the aligned calls.
//!
//! Kept out of the library, which forbids unsafe code: each binary includes
//! this file and declares the allocator itself.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys::{
    mi_free, mi_malloc, mi_malloc_aligned, mi_realloc, mi_realloc_aligned, mi_zalloc, mi_zalloc_aligned,
};

/// Turns transparent huge pages off for this process, unless the operator
/// set `MIMALLOC_ALLOW_THP` (the kernel's `always` mode then applies). mimalloc is built never to ask for them
/// (`no_thp`: no `madvise` on the arenas it maps), which is enough on a
/// kernel in `madvise` mode; this covers `always` mode, where the kernel
/// would back every arena with 2 MiB pages anyway. A huge page stays
/// resident for what a few parked connections use of it: an idle HTTP/1.1
/// connection cost 5.4 KiB with them and 3.1 without
/// (`benches/idle_conns.py`, 10,000 connections; docs/benchmarks.md).
/// Called first thing in `main`, before the runtime's threads exist: the
/// setting is the process's, and children inherit it. Memory taken before
/// `main` (a few MiB at most) keeps what it got.
pub fn without_huge_pages() {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // SAFETY: PR_SET_THP_DISABLE takes integers only and touches no
        // memory of this process; a kernel without it returns an error,
        // which leaves huge pages as they were.
        unsafe {
            libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
        }
    }
}

/// The largest alignment mimalloc's plain calls guarantee
/// (`MI_MAX_ALIGN_SIZE`, alignof(max_align_t) on x86-64 and aarch64).
const PLAIN_ALIGN: usize = 16;

/// Whether a block of `size` bytes from plain `mi_malloc` has `align`.
fn plain(size: usize, align: usize) -> bool {
    align <= PLAIN_ALIGN && align <= size
}

/// mimalloc, through its plain calls whenever they give the alignment asked.
pub struct Mimalloc;

// SAFETY: every method hands the layout's size (and, when the plain calls
// cannot promise it, its alignment) to mimalloc, whose blocks are valid
// for that size until `mi_free`; `mi_free` and `mi_realloc*` accept blocks
// from any of the calls.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: see the impl.
        unsafe {
            if plain(layout.size(), layout.align()) {
                mi_malloc(layout.size()) as *mut u8
            } else {
                mi_malloc_aligned(layout.size(), layout.align()) as *mut u8
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: see the impl.
        unsafe {
            if plain(layout.size(), layout.align()) {
                mi_zalloc(layout.size()) as *mut u8
            } else {
                mi_zalloc_aligned(layout.size(), layout.align()) as *mut u8
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: see the impl.
        unsafe { mi_free(ptr as *mut c_void) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: see the impl.
        unsafe {
            if plain(new_size, layout.align()) {
                mi_realloc(ptr as *mut c_void, new_size) as *mut u8
            } else {
                mi_realloc_aligned(ptr as *mut c_void, new_size, layout.align()) as *mut u8
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_have_the_alignment_asked() {
        let mut blocks = Vec::new();
        for size in 1..=4096 {
            for align in [1, 2, 4, 8, 16, 32, 64] {
                let layout = Layout::from_size_align(size, align).expect("layout");
                // SAFETY: a non-zero size; freed below with the same layout.
                let p = unsafe { Mimalloc.alloc(layout) };
                assert!(!p.is_null() && (p as usize).is_multiple_of(align), "size {size} align {align}");
                blocks.push((p, layout));
            }
        }
        for (p, layout) in blocks {
            // SAFETY: allocated above with this layout.
            unsafe { Mimalloc.dealloc(p, layout) };
        }
    }
}
