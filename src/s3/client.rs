//! The object-store client: HEAD, GET into a region block, PUT of a block, each with a per-attempt
//! timeout, retries with exponential backoff and full jitter, and error classification. The only
//! file that names aws-sdk-s3 types besides the client construction in `mod.rs`.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::Client;
use bytes::Bytes;

use crate::config::S3Config;
use crate::metrics::{S3Metrics, S3OpMetrics};

/// User metadata holding the block's crc32c (lowercase hex), written by kvtier's uploads and
/// verified by its GETs when present; vLLM's objects have none and are accepted without.
pub(crate) const CRC_METADATA: &str = "kvtier-crc32c";

/// Longest pause between two attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(2);
const BACKOFF_BASE_MS: u64 = 50;

/// The longest pause between two attempts.
pub(crate) fn backoff_max() -> Duration {
    BACKOFF_MAX
}

/// Why an operation did not succeed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// 404 for HEAD or GET: the object does not exist (a miss, not an error).
    NotFound,
    /// The engine is shutting down; no attempt was made (or no retry).
    Closed,
    /// The object's size is not the block size.
    Size { got: u64, want: u64 },
    /// The object's bytes do not match the crc32c kvtier stored with it.
    Checksum { object: String },
    /// Failed for good: not retryable, or still failing after the retries. The text names the
    /// operation, the object and the last cause.
    Failed(String),
}

/// The outcome of one attempt.
pub(crate) enum Attempt<T> {
    Done(T),
    /// Retry if the budget allows; the text is the cause.
    Retry(String),
    /// Stop now.
    Stop(Failure),
}

pub(crate) struct ObjectClient {
    pub client: Client,
    pub bucket: String,
    pub endpoint: String,
    pub timeout: Duration,
    pub retries: u32,
    pub metrics: Arc<S3Metrics>,
    pub closing: Arc<AtomicBool>,
    jitter: AtomicU64,
    /// Consecutive operations that failed for good: one line when the store stops answering,
    /// one when it answers again.
    health: crate::logs::Health,
}

/// Operations failed in a row (each after its retries) before the store counts as down.
const DOWN_AFTER_FAILURES: u32 = 5;

impl ObjectClient {
    pub fn new(
        client: Client,
        bucket: String,
        endpoint: String,
        timeout: Duration,
        retries: u32,
        metrics: Arc<S3Metrics>,
        closing: Arc<AtomicBool>,
    ) -> ObjectClient {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        ObjectClient {
            client,
            bucket,
            endpoint,
            timeout,
            retries,
            metrics,
            closing,
            jitter: AtomicU64::new(seed | 1),
            health: crate::logs::Health::new(DOWN_AFTER_FAILURES),
        }
    }

    /// Exponential backoff with full jitter: uniform in [0, min(max, base × 2^attempt)].
    fn backoff(&self, attempt: u32) -> Duration {
        let ceiling = (BACKOFF_BASE_MS << attempt.min(16)).min(BACKOFF_MAX.as_millis() as u64);
        let x = self.jitter.fetch_add(0x9E37_79B9_7F4A_7C15, Relaxed);
        let r = xxhash_rust::xxh3::xxh3_64(&x.to_le_bytes());
        Duration::from_millis(r % (ceiling + 1))
    }

    /// Runs `attempt` until it is done, stops, or the retry budget is spent; each attempt is
    /// bounded by the configured timeout. Counts requests, retries, errors and latency in `op`.
    pub async fn run<T, F, Fut>(
        &self,
        op: &S3OpMetrics,
        what: &str,
        name: &str,
        mut attempt: F,
    ) -> Result<T, Failure>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Attempt<T>>,
    {
        let started = Instant::now();
        let mut tries = 0u32;
        let result = loop {
            if self.closing.load(Relaxed) {
                break Err(Failure::Closed);
            }
            op.requests.fetch_add(1, Relaxed);
            let outcome = tokio::time::timeout(self.timeout, attempt())
                .await
                .unwrap_or_else(|_| {
                    Attempt::Retry(format!(
                        "no complete answer within timeout_ms = {}",
                        self.timeout.as_millis()
                    ))
                });
            match outcome {
                Attempt::Done(v) => break Ok(v),
                Attempt::Stop(f) => break Err(f),
                Attempt::Retry(cause) if tries >= self.retries => {
                    break Err(Failure::Failed(format!(
                        "{what} s3://{}/{name} at {}: {cause} (after {} attempt{})",
                        self.bucket,
                        self.endpoint,
                        tries + 1,
                        if tries == 0 { "" } else { "s" }
                    )));
                }
                Attempt::Retry(cause) => {
                    tracing::debug!(
                        op = what,
                        object = name,
                        attempt = tries + 1,
                        "retrying: {cause}"
                    );
                    op.retries.fetch_add(1, Relaxed);
                    tokio::time::sleep(self.backoff(tries)).await;
                    tries += 1;
                }
            }
        };
        op.latency.record(started.elapsed().as_micros() as u64);
        match &result {
            Err(Failure::Failed(cause)) => {
                op.errors.fetch_add(1, Relaxed);
                if self.health.failure() {
                    tracing::error!(
                        endpoint = %self.endpoint,
                        bucket = %self.bucket,
                        "the object store stopped answering: {DOWN_AFTER_FAILURES} operations \
                         in a row failed after their retries (last: {cause}). Loads of keys not \
                         on NVMe fail (vLLM recomputes them) and uploads are dropped until it \
                         answers; check s3.endpoint, the credentials and the network"
                    );
                }
            }
            Err(Failure::Checksum { .. } | Failure::Size { .. }) => {
                op.errors.fetch_add(1, Relaxed);
            }
            Ok(_) => {
                if self.health.success() {
                    tracing::info!(
                        endpoint = %self.endpoint,
                        bucket = %self.bucket,
                        "the object store answers again"
                    );
                }
            }
            Err(_) => {}
        }
        result
    }

    /// Whether the object exists (HEAD).
    pub async fn head(&self, name: &str) -> Result<bool, Failure> {
        let r = self
            .run(&self.metrics.head, "HEAD", name, || async {
                match self
                    .client
                    .head_object()
                    .bucket(&self.bucket)
                    .key(name)
                    .send()
                    .await
                {
                    Ok(_) => Attempt::Done(()),
                    Err(e) => classify(&e),
                }
            })
            .await;
        match r {
            Ok(()) => Ok(true),
            Err(Failure::NotFound) => Ok(false),
            Err(f) => Err(f),
        }
    }

    /// GETs the object straight into `offset..offset + len` of the load's leased blocks (in
    /// whichever of the node's regions its client works), chunk by chunk as the body arrives
    /// (no staging copy of the block). Fails unless the object is exactly `len` bytes and,
    /// when it carries kvtier's crc32c, matches it.
    pub async fn get_into(
        &self,
        name: &str,
        into: &kvtier_sys::blocks::Lease,
        offset: usize,
        len: usize,
    ) -> Result<u64, Failure> {
        let bytes = self
            .run(&self.metrics.get, "GET", name, || async {
                let mut out = match self
                    .client
                    .get_object()
                    .bucket(&self.bucket)
                    .key(name)
                    .send()
                    .await
                {
                    Ok(out) => out,
                    Err(e) => return classify(&e),
                };
                let declared = out.content_length().unwrap_or(-1);
                if u64::try_from(declared).ok() != Some(len as u64) {
                    return Attempt::Stop(Failure::Size {
                        got: declared.max(0) as u64,
                        want: len as u64,
                    });
                }
                let expected = out
                    .metadata()
                    .and_then(|m| m.get(CRC_METADATA))
                    .and_then(|v| u32::from_str_radix(v, 16).ok());
                let mut pos = 0usize;
                let mut crc = crate::checksum::Crc32c::new();
                loop {
                    match out.body.try_next().await {
                        Ok(Some(chunk)) => {
                            if pos + chunk.len() > len {
                                return Attempt::Stop(Failure::Size {
                                    got: (pos + chunk.len()) as u64,
                                    want: len as u64,
                                });
                            }
                            into.write(offset + pos, &chunk);
                            if expected.is_some() {
                                crc.update(&chunk);
                            }
                            pos += chunk.len();
                        }
                        Ok(None) => break,
                        Err(e) => {
                            return Attempt::Retry(format!(
                                "body interrupted after {pos} of {len} bytes: {e}"
                            ))
                        }
                    }
                }
                if pos != len {
                    return Attempt::Retry(format!("body ended after {pos} of {len} bytes"));
                }
                if expected.is_some_and(|e| e != crc.value()) {
                    return Attempt::Stop(Failure::Checksum {
                        object: name.to_owned(),
                    });
                }
                Attempt::Done(len as u64)
            })
            .await?;
        self.metrics.get.bytes.fetch_add(bytes, Relaxed);
        Ok(bytes)
    }

    /// PUTs one block (`body` is a copy of it) with its crc32c as user metadata.
    pub async fn put(&self, name: &str, body: Bytes) -> Result<(), Failure> {
        let crc = format!("{:08x}", crate::checksum::crc32c(&body));
        let len = body.len() as u64;
        self.run(&self.metrics.put, "PUT", name, || async {
            match self
                .client
                .put_object()
                .bucket(&self.bucket)
                .key(name)
                .content_length(i64::try_from(len).unwrap_or(i64::MAX))
                .metadata(CRC_METADATA, &crc)
                .body(ByteStream::from(body.clone()))
                .send()
                .await
            {
                Ok(_) => Attempt::Done(()),
                Err(e) => classify(&e),
            }
        })
        .await?;
        self.metrics.put.bytes.fetch_add(len, Relaxed);
        Ok(())
    }

    /// The connectivity probe at open: a HEAD of an object that cannot exist (found or not
    /// found both pass), then, on "not found", a HEAD of the bucket to tell a missing bucket
    /// apart (a HEAD answer has no body, so S3 cannot say which of the two is missing).
    pub async fn probe(&self, name: &str) -> Result<(), String> {
        let status = |e: &SdkError<_, _>| {
            e.raw_response()
                .map(|r: &aws_sdk_s3::config::http::HttpResponse| r.status().as_u16())
        };
        let first = tokio::time::timeout(
            self.timeout,
            self.client
                .head_object()
                .bucket(&self.bucket)
                .key(name)
                .send(),
        )
        .await;
        match first {
            Err(_) => Err(format!(
                "no answer within timeout_ms = {}: is the endpoint reachable (host, port, \
                 firewall)?",
                self.timeout.as_millis()
            )),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => match status(&e) {
                Some(404) => self.probe_bucket().await,
                Some(code) => Err(http_cause(code, e.code())),
                None => Err(transport_cause(&e)),
            },
        }
    }

    async fn probe_bucket(&self) -> Result<(), String> {
        match tokio::time::timeout(
            self.timeout,
            self.client.head_bucket().bucket(&self.bucket).send(),
        )
        .await
        {
            Err(_) => Err(format!(
                "no answer within timeout_ms = {}",
                self.timeout.as_millis()
            )),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => match e.raw_response().map(|r| r.status().as_u16()) {
                Some(404) => Err(
                    "the bucket does not exist (HTTP 404 NoSuchBucket): create it, \
                     or fix `bucket` (and `force_path_style` for servers that need path-style \
                     URLs)"
                        .into(),
                ),
                // A HEAD of the bucket may be denied where object requests are allowed.
                Some(403) => Ok(()),
                Some(code) => Err(http_cause(code, e.code())),
                None => Err(transport_cause(&e)),
            },
        }
    }
}

fn http_cause(status: u16, code: Option<&str>) -> String {
    let code = code.map(|c| format!(" {c}")).unwrap_or_default();
    let hint = match status {
        400 => "a bad request: check `region` (and `force_path_style`)",
        401 | 403 => {
            "access denied: check the credentials (access_key_id / secret_access_key / \
             session_token, or the AWS default chain) and the bucket policy"
        }
        301 | 307 => "the bucket lives elsewhere: check `region` and `endpoint`",
        _ => "the server refused the request",
    };
    format!("HTTP {status}{code}: {hint}")
}

fn transport_cause<E: std::error::Error + 'static>(
    e: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
) -> String {
    let text = aws_sdk_s3::error::DisplayErrorContext(e).to_string();
    let lower = text.to_lowercase();
    let hint = if lower.contains("credential") {
        "no usable credentials: set access_key_id and secret_access_key in [s3], or configure \
         the AWS default chain (env AWS_ACCESS_KEY_ID..., ~/.aws, instance role)"
    } else if lower.contains("dns") || lower.contains("resolve") || lower.contains("lookup") {
        "the endpoint's host name does not resolve (DNS)"
    } else if lower.contains("certificate") || lower.contains("tls") || lower.contains("handshake")
    {
        "TLS failed: check the scheme (http/https) and the server's certificate"
    } else if lower.contains("refused") || lower.contains("connect") {
        "cannot connect: is the server running and the endpoint's host and port right?"
    } else {
        "the request could not be sent"
    };
    format!("{hint} ({text})")
}

/// Sorts an SDK error into miss, retry or stop.
pub(crate) fn classify<T, E>(e: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>) -> Attempt<T>
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let status = e.raw_response().map(|r| r.status().as_u16());
    match e {
        SdkError::ServiceError(se) => {
            let code = se.err().code();
            let throttled = matches!(
                code,
                Some("SlowDown" | "Throttling" | "ThrottlingException" | "RequestTimeout")
            );
            match status {
                Some(404) if code == Some("NoSuchBucket") => {
                    Attempt::Stop(Failure::Failed(http_cause(404, code)))
                }
                Some(404) => Attempt::Stop(Failure::NotFound),
                Some(s) if s >= 500 || s == 429 || s == 408 || throttled => {
                    Attempt::Retry(format!(
                        "HTTP {s}{}",
                        code.map(|c| format!(" {c}")).unwrap_or_default()
                    ))
                }
                Some(s) => Attempt::Stop(Failure::Failed(http_cause(s, code))),
                None => Attempt::Retry(aws_sdk_s3::error::DisplayErrorContext(e).to_string()),
            }
        }
        SdkError::ConstructionFailure(_) => Attempt::Stop(Failure::Failed(format!(
            "the request could not be built: {}",
            aws_sdk_s3::error::DisplayErrorContext(e)
        ))),
        // Timeouts, connection errors, malformed or cut-off responses.
        _ => Attempt::Retry(transport_cause(e)),
    }
}

pub(super) async fn build_client(cfg: &S3Config) -> aws_sdk_s3::Client {
    use aws_sdk_s3::config::{
        retry::RetryConfig, timeout::TimeoutConfig, BehaviorVersion, Credentials,
        Region as AwsRegion, RequestChecksumCalculation, ResponseChecksumValidation,
    };
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https();
    let timeout = Duration::from_millis(cfg.timeout_ms);
    let mut loader = aws_config::defaults(BehaviorVersion::latest())
        .region(AwsRegion::new(cfg.region.clone()))
        .http_client(http)
        // kvtier retries itself (and counts the retries); one attempt per SDK call.
        .retry_config(RetryConfig::disabled())
        // The whole attempt (body included) is bounded by kvtier's own timeout around it, so
        // the error names `timeout_ms`; the SDK only bounds the connect.
        .timeout_config(TimeoutConfig::builder().connect_timeout(timeout).build());
    if let (Some(id), Some(secret)) = (&cfg.access_key_id, &cfg.secret_access_key) {
        loader = loader.credentials_provider(Credentials::new(
            id.expose(),
            secret.expose(),
            cfg.session_token.as_ref().map(|t| t.expose().to_owned()),
            None,
            "kvtier-config",
        ));
    }
    let sdk = loader.load().await;
    let mut b = aws_sdk_s3::config::Builder::from(&sdk)
        .force_path_style(cfg.force_path_style)
        // kvtier keeps its own crc32c in the object's metadata; the SDK's default trailing
        // checksums would need aws-chunked uploads that not every S3-compatible server takes.
        .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
        .response_checksum_validation(ResponseChecksumValidation::WhenRequired);
    if let Some(endpoint) = &cfg.endpoint {
        b = b.endpoint_url(endpoint);
    }
    aws_sdk_s3::Client::from_conf(b.build())
}
