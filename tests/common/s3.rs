//! A real S3-compatible server for the S3 tier's tests: `s3s-fs` (installed by `.ci/run`), one
//! private process per test on a free 127.0.0.1 port, killed when dropped. The plain aws-sdk-s3
//! client checks and seeds objects next to the engine.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const ACCESS_KEY: &str = "kvtier-test";
pub const SECRET_KEY: &str = "kvtier-test-secret";
pub const BUCKET: &str = "kvtier-test";

pub struct S3Server {
    pub port: u16,
    pub root: tempfile::TempDir,
    child: Option<Child>,
}

/// The s3s-fs binary: `$KVTIER_S3S_FS`, else on PATH, else in ~/.cargo/bin.
pub fn s3s_fs_binary() -> PathBuf {
    if let Ok(p) = std::env::var("KVTIER_S3S_FS") {
        return PathBuf::from(p);
    }
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        let p = PathBuf::from(dir).join("s3s-fs");
        if p.is_file() {
            return p;
        }
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let p = PathBuf::from(home).join(".cargo/bin/s3s-fs");
    assert!(
        p.is_file(),
        "the S3 tests need s3s-fs: `cargo install s3s-fs@0.14.1 --features binary --locked` \
         (.ci/run does it), or set KVTIER_S3S_FS"
    );
    p
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

impl S3Server {
    /// Starts a server with bucket [`BUCKET`].
    pub fn start() -> S3Server {
        let root = tempfile::Builder::new()
            .prefix("kvtier-s3")
            .tempdir()
            .expect("server root");
        std::fs::create_dir(root.path().join(BUCKET)).expect("bucket directory");
        let mut s = S3Server {
            port: free_port(),
            root,
            child: None,
        };
        s.restart();
        s
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Starts (again) on the same port and directory.
    pub fn restart(&mut self) {
        self.restart_with_keys(ACCESS_KEY, SECRET_KEY);
    }

    /// Starts (again) on the same port and directory, accepting only these credentials (a
    /// rotated secret: clients holding the old one get 403).
    pub fn restart_with_keys(&mut self, access_key: &str, secret_key: &str) {
        assert!(self.child.is_none(), "already running");
        let child = Command::new(s3s_fs_binary())
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", access_key, "--secret-key", secret_key])
            .arg(self.root.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("s3s-fs starts");
        self.child = Some(child);
        let addr = self.addr();
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(Instant::now() < deadline, "s3s-fs did not listen on {addr}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server (SIGKILL): connections are refused until `restart`.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The plain SDK client, for checking and seeding objects.
    pub fn client(&self) -> Sdk {
        Sdk::new(&self.endpoint())
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// aws-sdk-s3 on a small runtime of its own, with blocking helpers.
pub struct Sdk {
    rt: tokio::runtime::Runtime,
    client: aws_sdk_s3::Client,
    bucket: String,
}

impl Sdk {
    pub fn new(endpoint: &str) -> Sdk {
        Sdk::connect(endpoint, "us-east-1", ACCESS_KEY, SECRET_KEY, BUCKET)
    }

    /// A client of any S3 endpoint (a Garage cluster, say) and bucket.
    pub fn connect(
        endpoint: &str,
        region: &str,
        access_key: &str,
        secret_key: &str,
        bucket: &str,
    ) -> Sdk {
        use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let conf = aws_sdk_s3::config::Builder::new()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(region.to_owned()))
            .endpoint_url(endpoint)
            .force_path_style(true)
            .http_client(
                aws_smithy_http_client::Builder::new()
                    .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                        aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
                    ))
                    .build_https(),
            )
            .credentials_provider(Credentials::new(
                access_key.to_owned(),
                secret_key.to_owned(),
                None,
                None,
                "test",
            ))
            .build();
        Sdk {
            rt,
            client: aws_sdk_s3::Client::from_conf(conf),
            bucket: bucket.to_owned(),
        }
    }

    pub fn put(&self, name: &str, bytes: Vec<u8>) {
        self.rt
            .block_on(
                self.client
                    .put_object()
                    .bucket(&self.bucket)
                    .key(name)
                    .body(bytes.into())
                    .send(),
            )
            .expect("PUT through the plain SDK");
    }

    /// The object's bytes, or `None` if it does not exist.
    pub fn get(&self, name: &str) -> Option<Vec<u8>> {
        self.rt.block_on(async {
            match self
                .client
                .get_object()
                .bucket(&self.bucket)
                .key(name)
                .send()
                .await
            {
                Ok(out) => Some(
                    out.body
                        .collect()
                        .await
                        .expect("object body")
                        .into_bytes()
                        .to_vec(),
                ),
                Err(e) => {
                    let status = e.raw_response().map(|r| r.status().as_u16());
                    assert_eq!(status, Some(404), "GET {name}: {e:?}");
                    None
                }
            }
        })
    }

    /// Every object name in the bucket.
    pub fn list(&self) -> Vec<String> {
        self.rt.block_on(async {
            let out = self
                .client
                .list_objects_v2()
                .bucket(&self.bucket)
                .send()
                .await
                .expect("LIST");
            out.contents()
                .iter()
                .filter_map(|o| o.key().map(str::to_owned))
                .collect()
        })
    }
}
