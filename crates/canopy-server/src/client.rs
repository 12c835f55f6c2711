//! A small blocking HTTP/1.1 client for canopy's own server, for tests: one connection per
//! request (`Connection: close`); bodies of a length or chunked; a streamed response read
//! event by event as it arrives ([`EventLines`], which `canopy bench serve`'s async client
//! reads its streams with too).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A server's address and key.
#[derive(Debug, Clone)]
pub struct Client {
    pub addr: SocketAddr,
    pub api_key: Option<String>,
    pub timeout: Duration,
}

/// A whole response.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

impl Client {
    pub fn new(addr: SocketAddr) -> Client {
        Client {
            addr,
            api_key: None,
            timeout: Duration::from_secs(300),
        }
    }

    pub fn get(&self, path: &str) -> io::Result<Reply> {
        self.send("GET", path, None)?.whole()
    }

    pub fn post(&self, path: &str, body: &str) -> io::Result<Reply> {
        self.send("POST", path, Some(body.as_bytes()))?.whole()
    }

    /// Posts `body` and returns the response as it arrives, for streamed events.
    pub fn stream(&self, path: &str, body: &str) -> io::Result<Streamed> {
        self.send("POST", path, Some(body.as_bytes()))
    }

    /// Sends a request with `body` as it is (any bytes, any declared length).
    pub fn send(&self, method: &str, path: &str, body: Option<&[u8]>) -> io::Result<Streamed> {
        let mut conn = TcpStream::connect_timeout(&self.addr, self.timeout)?;
        conn.set_read_timeout(Some(self.timeout))?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n",
            self.addr
        );
        if let Some(key) = &self.api_key {
            head.push_str(&format!("Authorization: Bearer {key}\r\n"));
        }
        if let Some(b) = body {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            ));
        }
        head.push_str("\r\n");
        conn.write_all(head.as_bytes())?;
        if let Some(b) = body {
            conn.write_all(b)?;
        }
        Streamed::read_head(conn)
    }
}

/// A response whose head has been read; its body is read on demand.
pub struct Streamed {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    body: Box<dyn BufRead + Send>,
}

impl Streamed {
    fn read_head(conn: TcpStream) -> io::Result<Streamed> {
        let mut reader = BufReader::new(conn);
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the server closed the connection before replying",
            ));
        }
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad(format!("not an HTTP status line: {line:?}")))?;
        let mut headers = Vec::new();
        loop {
            line.clear();
            reader.read_line(&mut line)?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((n, v)) = l.split_once(':') {
                headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
        }
        let find = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let body: Box<dyn BufRead + Send> =
            if find("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
                Box::new(BufReader::new(Chunked {
                    inner: reader,
                    left: 0,
                    done: false,
                }))
            } else if let Some(len) = find("content-length").and_then(|v| v.parse::<u64>().ok()) {
                Box::new(reader.take(len))
            } else {
                Box::new(reader)
            };
        Ok(Streamed {
            status,
            headers,
            body,
        })
    }

    /// The rest of the body, then the response whole.
    pub fn whole(mut self) -> io::Result<Reply> {
        let mut body = String::new();
        self.body.read_to_string(&mut body)?;
        Ok(Reply {
            status: self.status,
            headers: self.headers,
            body,
        })
    }

    /// The next server-sent event's data (`None` at the end of the body).
    pub fn next_event(&mut self) -> io::Result<Option<String>> {
        let mut events = EventLines::default();
        let mut line = String::new();
        loop {
            line.clear();
            if self.body.read_line(&mut line)? == 0 {
                return Ok(events.end());
            }
            if let Some(data) = events.line(&line) {
                return Ok(Some(data));
            }
        }
    }
}

/// Server-sent events read line by line: the data of an event comes back at the blank line
/// that ends it; comments and other fields are skipped.
#[derive(Debug, Default)]
pub struct EventLines {
    data: Option<String>,
}

impl EventLines {
    /// Takes one line (its end of line optional); returns the data of the event it ends.
    pub fn line(&mut self, line: &str) -> Option<String> {
        let l = line.trim_end_matches(['\r', '\n']);
        if l.is_empty() {
            return self.data.take();
        }
        if let Some(d) = l.strip_prefix("data:") {
            let d = d.strip_prefix(' ').unwrap_or(d);
            match &mut self.data {
                Some(x) => {
                    x.push('\n');
                    x.push_str(d);
                }
                None => self.data = Some(d.to_string()),
            }
        }
        None
    }

    /// The data of an event that the body's end cut short.
    pub fn end(&mut self) -> Option<String> {
        self.data.take()
    }
}

/// A chunked body, de-chunked.
struct Chunked<R> {
    inner: R,
    left: usize,
    done: bool,
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            self.inner.read_line(&mut line)?;
            let size = line.trim().split(';').next().unwrap_or("");
            self.left = usize::from_str_radix(size, 16)
                .map_err(|_| bad(format!("bad chunk size {line:?}")))?;
            if self.left == 0 {
                self.done = true;
                return Ok(0);
            }
        }
        let room = buf.len().min(self.left);
        let n = self.inner.read(&mut buf[..room])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the body ended inside a chunk",
            ));
        }
        self.left -= n;
        if self.left == 0 {
            let mut crlf = String::new();
            self.inner.read_line(&mut crlf)?;
        }
        Ok(n)
    }
}

fn bad(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

#[cfg(test)]
mod tests {
    use super::EventLines;

    #[test]
    fn events_end_at_blank_lines_and_join_their_data_lines() {
        let mut e = EventLines::default();
        let lines = [
            ": keep-alive",
            "",
            "data: {\"a\":1}\r\n",
            "",
            "data:x",
            "data: y",
            "id: 3",
            "",
        ];
        let got: Vec<String> = lines.iter().filter_map(|l| e.line(l)).collect();
        assert_eq!(got, ["{\"a\":1}", "x\ny"]);
        assert_eq!(e.line("data: [DONE]"), None);
        assert_eq!(e.end().as_deref(), Some("[DONE]"));
        assert_eq!(e.end(), None);
    }
}
