//! With the `link` feature: bindings to SPDK's headers under `$SPDK_DIR/include`
//! (bindgen, libclang) as a table of functions loaded at run time (`Spdk`), and the
//! list of libraries to load, as `pkg-config` lists them for the packages the device
//! needs. Without it, nothing.

fn main() {
    println!("cargo:rerun-if-env-changed=SPDK_DIR");
    println!("cargo:rerun-if-changed=wrapper.h");
    #[cfg(feature = "link")]
    link::run();
}

#[cfg(feature = "link")]
mod link {
    use std::path::PathBuf;
    use std::process::Command;

    /// SPDK's libraries the bdev device needs, by pkg-config name.
    const PACKAGES: &[&str] = &[
        "spdk_env_dpdk",
        "spdk_thread",
        "spdk_init",
        "spdk_event_bdev",
        "spdk_bdev",
        "spdk_bdev_malloc",
        "spdk_bdev_nvme",
        "spdk_sock_posix",
        "spdk_syslibs",
    ];

    /// The functions the device calls (and the types they need).
    const FUNCTIONS: &[&str] = &[
        "spdk_env_opts_init",
        "spdk_env_init",
        "spdk_env_fini",
        "spdk_unaffinitize_thread",
        "spdk_thread_lib_init",
        "spdk_thread_lib_fini",
        "spdk_thread_create",
        "spdk_set_thread",
        "spdk_thread_poll",
        "spdk_thread_exit",
        "spdk_thread_is_exited",
        "spdk_thread_destroy",
        "spdk_subsystem_init",
        "spdk_subsystem_load_config",
        "spdk_subsystem_fini",
        "spdk_rpc_set_state",
        "spdk_bdev_open_ext",
        "spdk_bdev_close",
        "spdk_bdev_desc_get_bdev",
        "spdk_bdev_get_io_channel",
        "spdk_put_io_channel",
        "spdk_bdev_get_buf_align",
        "spdk_bdev_get_block_size",
        "spdk_bdev_get_num_blocks",
        "spdk_bdev_io_type_supported",
        "spdk_bdev_read_blocks",
        "spdk_bdev_write_blocks",
        "spdk_bdev_flush_blocks",
        "spdk_bdev_unmap_blocks",
        "spdk_bdev_free_io",
        "spdk_dma_malloc",
        "spdk_dma_zmalloc",
        "spdk_dma_free",
    ];

    fn missing(why: String) -> ! {
        panic!(
            "\n\nthe `spdk` feature needs an SPDK build: {why}\n\
             Build one with `scripts/build-spdk.sh SPDK_SOURCE_DIR` (a github.com/spdk/spdk \
             checkout at v25.09) and set SPDK_DIR=SPDK_SOURCE_DIR.\n\n"
        )
    }

    pub(super) fn run() {
        let dir = std::env::var_os("SPDK_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| missing("SPDK_DIR is not set".into()));
        let include = dir.join("include");
        let lib = dir.join("build/lib");
        if !include.join("spdk/bdev.h").is_file() || !lib.join("pkgconfig").is_dir() {
            missing(format!(
                "{} has no include/spdk/bdev.h or build/lib/pkgconfig",
                dir.display()
            ));
        }
        let out = Command::new("pkg-config")
            .env("PKG_CONFIG_PATH", lib.join("pkgconfig"))
            .args(["--libs", "--static"])
            .args(PACKAGES)
            .output()
            .unwrap_or_else(|e| missing(format!("running pkg-config: {e}")));
        if !out.status.success() {
            missing(format!(
                "pkg-config {}: {}",
                PACKAGES.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        // Nothing is linked: SPDK's libraries (and what they leave to the program:
        // OpenSSL, uuid, aio, …) are loaded at run time, in this order where their
        // dependencies allow, so that its modules' constructors run and a build
        // without SPDK installed still starts.
        let mut names: Vec<String> = Vec::new();
        for flag in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Some(name) = flag.strip_prefix("-l")
                && !names.iter().any(|s| s == name)
            {
                names.push(name.to_string());
            }
        }
        let quoted: Vec<String> = names.iter().map(|n| format!("{n:?}")).collect();
        let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
        std::fs::write(
            out_dir.join("libraries.rs"),
            format!("pub const LIBRARIES: &[&str] = &[{}];\n", quoted.join(", ")),
        )
        .expect("writing the library list");
        println!("cargo:rustc-env=CSD_SPDK_LIB_DIR={}", lib.display());
        let bindings = bindgen::Builder::default()
            .header("wrapper.h")
            .clang_arg(format!("-I{}", include.display()))
            .allowlist_function(FUNCTIONS.join("|"))
            .allowlist_var("SPDK_RPC_RUNTIME")
            .allowlist_type("spdk_bdev_io_type")
            // Packed structures holding aligned ones, which Rust cannot express.
            .opaque_type("spdk_nvme_ctrlr_data|spdk_bdev_ext_io_opts")
            .derive_default(true)
            .dynamic_library_name("Spdk")
            .dynamic_link_require_all(true)
            .layout_tests(false)
            .generate()
            .unwrap_or_else(|e| missing(format!("bindgen on {}: {e}", include.display())));
        let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
        bindings
            .write_to_file(out.join("bindings.rs"))
            .expect("writing the bindings");
    }
}
