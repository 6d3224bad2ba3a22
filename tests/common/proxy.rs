//! A fault-injecting TCP proxy in front of an S3 server, for the object-store fault campaign.
//!
//! Every connection is accepted on 127.0.0.1 and handled by its own thread according to the
//! proxy's [`Fault`] at accept time: passed through byte for byte to the upstream server,
//! answered with an S3 error (`503 SlowDown`, `500 InternalError`, ...) and closed, held open
//! without an answer (a stall), or closed at once. Switching the fault cuts every connection
//! opened before the switch, so the next request of a pooled client connection sees the new
//! fault (a request in flight at that moment sees its connection closed, as when a load
//! balancer drops it).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the proxy does with the connections it accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Forward to the upstream server.
    Pass,
    /// Answer `1 in every` connections with this HTTP status and S3 error code, pass the rest.
    Status {
        status: u16,
        code: &'static str,
        every: u32,
    },
    /// Accept and never answer.
    Stall,
    /// Accept and close at once, before reading anything.
    Close,
}

#[derive(Default)]
pub struct ProxyCounts {
    pub accepted: AtomicU64,
    pub passed: AtomicU64,
    pub answered_with_error: AtomicU64,
    pub stalled: AtomicU64,
    pub closed: AtomicU64,
    pub upstream_refused: AtomicU64,
}

struct State {
    fault: Fault,
    /// Sockets of the connections opened under the current fault (client and upstream sides).
    open: Vec<TcpStream>,
    /// Connections accepted so far, for `every`.
    seq: u64,
}

pub struct FaultProxy {
    pub port: u16,
    pub counts: Arc<ProxyCounts>,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
}

impl FaultProxy {
    /// Listens on a free 127.0.0.1 port and forwards to `upstream` (while [`Fault::Pass`]).
    pub fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy listens");
        let port = listener.local_addr().expect("address").port();
        let state = Arc::new(Mutex::new(State {
            fault: Fault::Pass,
            open: Vec::new(),
            seq: 0,
        }));
        let counts = Arc::new(ProxyCounts::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (st, c, s) = (Arc::clone(&state), Arc::clone(&counts), Arc::clone(&stop));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if s.load(Relaxed) {
                    break;
                }
                let Ok(client) = client else { continue };
                c.accepted.fetch_add(1, Relaxed);
                let (st, c) = (Arc::clone(&st), Arc::clone(&c));
                std::thread::spawn(move || serve(client, upstream, &st, &c));
            }
        });
        FaultProxy {
            port,
            counts,
            state,
            stop,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Switches to `fault`, cutting every connection opened before.
    pub fn set(&self, fault: Fault) {
        let mut st = self.state.lock().expect("proxy state");
        st.fault = fault;
        for s in st.open.drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    pub fn fault(&self) -> Fault {
        self.state.lock().expect("proxy state").fault
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        self.set(Fault::Close);
        // Wake the accept loop so it sees `stop`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Registers a socket clone so a later [`FaultProxy::set`] cuts it.
fn track(state: &Mutex<State>, s: &TcpStream) {
    if let Ok(c) = s.try_clone() {
        state.lock().expect("proxy state").open.push(c);
    }
}

fn serve(client: TcpStream, upstream: SocketAddr, state: &Mutex<State>, counts: &ProxyCounts) {
    let (fault, seq) = {
        let mut st = state.lock().expect("proxy state");
        st.seq += 1;
        (st.fault, st.seq)
    };
    track(state, &client);
    match fault {
        Fault::Status { every, .. } if seq % u64::from(every.max(1)) != 0 => {
            pass(client, upstream, state, counts);
        }
        Fault::Pass => pass(client, upstream, state, counts),
        Fault::Status { status, code, .. } => {
            counts.answered_with_error.fetch_add(1, Relaxed);
            answer_error(client, status, code);
        }
        Fault::Stall => {
            counts.stalled.fetch_add(1, Relaxed);
            // Read and drop whatever comes until the connection is cut (by `set` or the peer).
            let mut sink = [0u8; 16 << 10];
            let mut c = client;
            while matches!(c.read(&mut sink), Ok(n) if n > 0) {}
        }
        Fault::Close => {
            counts.closed.fetch_add(1, Relaxed);
            let _ = client.shutdown(Shutdown::Both);
        }
    }
}

fn pass(client: TcpStream, upstream: SocketAddr, state: &Mutex<State>, counts: &ProxyCounts) {
    let Ok(server) = TcpStream::connect_timeout(&upstream, Duration::from_secs(2)) else {
        counts.upstream_refused.fetch_add(1, Relaxed);
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    counts.passed.fetch_add(1, Relaxed);
    track(state, &server);
    let (Ok(mut c2), Ok(mut s2)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let up = std::thread::spawn(move || {
        let _ = std::io::copy(&mut c2, &mut s2);
        let _ = s2.shutdown(Shutdown::Write);
    });
    let (mut c, mut s) = (client, server);
    let _ = std::io::copy(&mut s, &mut c);
    let _ = c.shutdown(Shutdown::Both);
    let _ = s.shutdown(Shutdown::Both);
    let _ = up.join();
}

/// Reads one request (head and a `Content-Length` body, unless it asks `100-continue`) and
/// answers it with an S3 error document, then closes.
fn answer_error(mut client: TcpStream, status: u16, code: &str) {
    let _ = client.set_read_timeout(Some(Duration::from_secs(5)));
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 64 << 10 {
        match client.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
    }
    let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let is_head = text.starts_with("head ");
    let wants_continue = text.contains("expect: 100-continue");
    let body_len = text
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    if !wants_continue {
        let _ = std::io::copy(&mut (&client).take(body_len), &mut std::io::sink());
    }
    let doc = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
         <Message>injected by the kvtier test proxy</Message></Error>"
    );
    let reason = match status {
        503 => "Slow Down",
        500 => "Internal Server Error",
        429 => "Too Many Requests",
        403 => "Forbidden",
        _ => "Error",
    };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/xml\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n",
        doc.len()
    )
    .into_bytes();
    if !is_head {
        out.extend_from_slice(doc.as_bytes());
    }
    let _ = client.write_all(&out);
    let _ = client.shutdown(Shutdown::Both);
}
