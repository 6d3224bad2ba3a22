//! `GET /metrics` over HTTP/1.1 (`[metrics] listen`), from a thread of its own: never a
//! worker's ring thread, never the S3 reactor. One connection at a time, each answered and
//! closed; a whole request must arrive within [`READ_DEADLINE`] and fit in [`REQUEST_MAX`]
//! bytes, and the answer must be taken within [`WRITE_DEADLINE`], so a stuck, slow or hostile
//! client holds the endpoint for at most their sum and costs no memory. The thread waits for
//! connections in `poll` with a timeout and checks the stop flag between them, so `stop`
//! returns within [`POLL_INTERVAL`] plus one connection's deadlines.
//!
//! The body is Prometheus text (0.0.4), or OpenMetrics text when the scraper's `Accept` asks for
//! `application/openmetrics-text` (as Prometheus itself does).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::metrics::render::{render, Format};
use crate::metrics::Stats;

const READ_DEADLINE: Duration = Duration::from_secs(2);
const WRITE_DEADLINE: Duration = Duration::from_secs(5);
const REQUEST_MAX: usize = 8192;
const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// What the endpoint reads: a snapshot of every counter now (the engine's `StatsSource`), so
/// this module needs nothing of the engine's.
pub(crate) trait StatsSnapshot: Send + Sync {
    fn stats(&self) -> Stats;
}

pub(crate) struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl MetricsServer {
    /// Binds `addr` and starts answering; a bad address or a port in use is an error naming
    /// `metrics.listen`.
    pub fn start(addr: SocketAddr, source: Arc<dyn StatsSnapshot>) -> Result<MetricsServer, Error> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            let hint = match e.kind() {
                std::io::ErrorKind::AddrInUse => {
                    "another process listens there: pick another port (or 0 for any free one)"
                }
                std::io::ErrorKind::AddrNotAvailable => {
                    "no interface of this machine has that address: use 127.0.0.1, 0.0.0.0 or \
                     one of its own addresses"
                }
                std::io::ErrorKind::PermissionDenied => {
                    "ports below 1024 need privileges: pick a port above 1024"
                }
                _ => "check the address",
            };
            Error::Metrics(format!(
                "metrics.listen = \"{addr}\": cannot listen: {e}; {hint}"
            ))
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Metrics(format!("metrics.listen = \"{addr}\": {e}")))?;
        // Accepted only once poll says a connection waits; never blocks if it went away.
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::Metrics(format!("metrics.listen = \"{addr}\": {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("kvtier-metrics".into())
            .spawn(move || serve(&listener, &flag, source.as_ref()))
            .map_err(|e| Error::Metrics(format!("starting the metrics thread: {e}")))?;
        tracing::info!(%addr, "metrics: serving GET /metrics");
        Ok(MetricsServer { addr, stop, thread })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops answering and joins the thread: within [`POLL_INTERVAL`], or the deadlines of a
    /// connection being served.
    pub fn stop(self) {
        self.stop.store(true, Ordering::Release);
        if self.thread.join().is_err() {
            tracing::error!("the metrics thread panicked");
        }
    }
}

fn serve(listener: &TcpListener, stop: &AtomicBool, source: &dyn StatsSnapshot) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let mut logged = 0u32;
    let timeout = PollTimeout::try_from(POLL_INTERVAL).unwrap_or(PollTimeout::MAX);
    while !stop.load(Ordering::Acquire) {
        let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {}
            Err(e) => {
                tracing::error!("metrics: poll on the listening socket failed: {}", e.desc());
                std::thread::sleep(POLL_INTERVAL);
                continue;
            }
        }
        let result = match listener.accept() {
            Ok((stream, _)) => answer(stream, source),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                // Out of file descriptors, say: do not spin on a listener that stays readable.
                std::thread::sleep(POLL_INTERVAL);
                Err(e)
            }
        };
        if let Err(e) = result {
            // A scraper that hangs up early, or a port scan: worth a line now and then only.
            logged += 1;
            if logged <= 5 || logged.is_multiple_of(1000) {
                tracing::debug!(count = logged, "metrics: connection failed: {e}");
            }
        }
    }
}

/// The time left before `deadline`, or a timed-out error.
fn left(deadline: Instant) -> std::io::Result<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::TimedOut))
}

/// What a request asks for.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Request {
    Metrics { head: bool, format: Format },
    NotFound,
    MethodNotAllowed,
    Bad,
}

/// Parses a request head (request line and headers).
pub(crate) fn parse_request(head: &[u8]) -> Request {
    let Ok(text) = std::str::from_utf8(head) else {
        return Request::Bad;
    };
    let mut lines = text.split("\r\n");
    let mut first = lines.next().unwrap_or("").split(' ');
    let (Some(method), Some(target), Some(version)) = (first.next(), first.next(), first.next())
    else {
        return Request::Bad;
    };
    if !version.starts_with("HTTP/1.") {
        return Request::Bad;
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Request::MethodNotAllowed,
    };
    let path = target.split('?').next().unwrap_or("");
    if path != "/metrics" {
        return Request::NotFound;
    }
    let openmetrics = lines.any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("accept") && v.contains("application/openmetrics-text")
        })
    });
    Request::Metrics {
        head: head_only,
        format: if openmetrics {
            Format::OpenMetrics
        } else {
            Format::Prometheus
        },
    }
}

fn answer(mut stream: TcpStream, source: &dyn StatsSnapshot) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    let read_by = Instant::now() + READ_DEADLINE;
    let mut buf = vec![0u8; REQUEST_MAX];
    let mut len = 0;
    let end = loop {
        if let Some(i) = buf[..len].windows(4).position(|w| w == b"\r\n\r\n") {
            break Some(i);
        }
        if len == buf.len() {
            break None;
        }
        stream.set_read_timeout(Some(left(read_by)?))?;
        let n = stream.read(&mut buf[len..])?;
        if n == 0 {
            // Closed before a whole request (the wake-up connection of `stop`, or a probe).
            return Ok(());
        }
        len += n;
    };
    let request = match end {
        Some(i) => parse_request(&buf[..i]),
        None => Request::Bad,
    };
    let (status, content_type, body, head) = match request {
        Request::Metrics { head, format } => (
            "200 OK",
            format.content_type(),
            render(source.stats(), format),
            head,
        ),
        Request::NotFound => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "kvtier serves GET /metrics only\n".to_owned(),
            false,
        ),
        Request::MethodNotAllowed => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "GET or HEAD only\n".to_owned(),
            false,
        ),
        Request::Bad => (
            "400 Bad Request",
            "text/plain; charset=utf-8",
            "bad request\n".to_owned(),
            false,
        ),
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head {
        out.extend_from_slice(body.as_bytes());
    }
    let write_by = Instant::now() + WRITE_DEADLINE;
    let mut sent = 0;
    while sent < out.len() {
        stream.set_write_timeout(Some(left(write_by)?))?;
        match stream.write(&out[sent..]) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_parsed_strictly() {
        assert_eq!(
            parse_request(b"GET /metrics HTTP/1.1\r\nHost: x"),
            Request::Metrics {
                head: false,
                format: Format::Prometheus
            }
        );
        assert_eq!(
            parse_request(
                b"GET /metrics?x=1 HTTP/1.1\r\naccept: application/openmetrics-text;version=1.0.0"
            ),
            Request::Metrics {
                head: false,
                format: Format::OpenMetrics
            }
        );
        assert_eq!(
            parse_request(b"HEAD /metrics HTTP/1.0"),
            Request::Metrics {
                head: true,
                format: Format::Prometheus
            }
        );
        assert_eq!(parse_request(b"GET / HTTP/1.1"), Request::NotFound);
        assert_eq!(parse_request(b"GET /metricsx HTTP/1.1"), Request::NotFound);
        assert_eq!(
            parse_request(b"POST /metrics HTTP/1.1"),
            Request::MethodNotAllowed
        );
        assert_eq!(parse_request(b"GET /metrics"), Request::Bad);
        assert_eq!(parse_request(b"GET /metrics SPDY/3"), Request::Bad);
        assert_eq!(parse_request(&[0xff, 0xfe]), Request::Bad);
    }
}
