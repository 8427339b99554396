//! What the shaped bench serves besides nodes: nginx for DuckDB's HTTP reads, and the
//! secure node's certificates and tenants file.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use csd_benches::net::{NODE_IP, Net};

pub(crate) fn start_nginx(net: &mut Net, data: &Path, work: &Path) -> String {
    let conf = work.join("nginx.conf");
    let w = work.display();
    std::fs::write(
        &conf,
        format!(
            "worker_processes 2;\npid {w}/nginx.pid;\nerror_log {w}/nginx.err;\nevents {{}}\n\
             http {{\n  access_log off;\n  sendfile on;\n  client_body_temp_path {w};\n  proxy_temp_path {w};\n  fastcgi_temp_path {w};\n  uwsgi_temp_path {w};\n  scgi_temp_path {w};\n  server {{\n    listen {NODE_IP}:8080;\n    root {};\n  }}\n}}\n",
            data.display()
        ),
    )
    .expect("nginx.conf");
    let child = net
        .in_ns("nginx")
        .args(["-c"])
        .arg(&conf)
        .args(["-g", "daemon off;"])
        .stderr(Stdio::null())
        .spawn()
        .expect("nginx (scripts/setup-shaped-bench.sh installs it)");
    net.children.push(child);
    std::thread::sleep(Duration::from_millis(300));
    format!("http://{NODE_IP}:8080")
}

/// The token of the bench's tenant on `secure` nodes.
pub(crate) const TOKEN: &str = "shaped-bench-token";

/// Certificates for the node's address and a tenants file, in `dir`.
pub(crate) fn write_security(dir: &Path) {
    let certs =
        csd_runtime::tls::make_certificates(&[NODE_IP.to_string()], "bench").expect("certificates");
    certs.write(dir).expect("writing certificates");
    std::fs::write(
        dir.join("tenants.toml"),
        format!(
            "[[tenant]]\nname = \"bench\"\ntoken_sha256 = \"{}\"\ntables = [\"*\"]\ncan = [\"read\"]\n",
            csd_runtime::auth::token_digest(TOKEN)
        ),
    )
    .expect("tenants file");
}
