//! Hostile: speaks the ABI but returns an output pointer far outside its memory.
//! Written against the raw ABI, without the SDK's macro.

#[unsafe(no_mangle)]
pub extern "C" fn csd_abi_version() -> i32 {
    csd_guest::ABI_VERSION
}

#[unsafe(no_mangle)]
pub extern "C" fn csd_kind() -> i32 {
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn csd_alloc(len: i32) -> i32 {
    csd_guest::__private::alloc(len)
}

#[unsafe(no_mangle)]
pub extern "C" fn csd_init(_ptr: i32, _len: i32) -> i64 {
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn csd_batch(_ptr: i32, _len: i32) -> i64 {
    (0x7fff_0000i64 << 32) | 0x0100_0000
}

#[unsafe(no_mangle)]
pub extern "C" fn csd_finish() -> i64 {
    csd_batch(0, 0)
}
