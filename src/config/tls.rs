//! `[[listen.tls]]`, `[listen] http_redirect`, `redirect_port`, `client_ca_file` and `client_auth`: the
//! certificates are read and checked here (each parses, each key goes with
//! its certificate), so `tollgate check` finds what the start would.

use std::net::SocketAddr;

use toml::Spanned;

use super::pem::{Certificate, ClientAuth};
use super::raw::{RawListen, RawTls};
use super::validate::Validator;

/// The HTTPS port redirects name when `redirect_port` is not set.
const DEFAULT_REDIRECT_PORT: u16 = 443;

impl Validator<'_> {
    /// The certificates of `[[listen.tls]]`, in order, the redirect
    /// listener's address and the HTTPS port its redirects name.
    pub(super) fn listen_tls(&mut self, listen: &RawListen) -> (Vec<Certificate>, Option<SocketAddr>, u16) {
        let tables: &[Spanned<RawTls>] = listen.tls.as_deref().unwrap_or_default();
        let mut certs = Vec::with_capacity(tables.len());
        for (i, table) in tables.iter().enumerate() {
            let t = table.get_ref();
            let cert = self.read_relative(&t.cert_file);
            let key = self.read_relative(&t.key_file);
            let (Some((cert_path, cert)), Some((key_path, key))) = (cert, key) else { continue };
            match Certificate::from_pem(&cert_path, &cert, &key_path, &key) {
                Ok(c) => {
                    if i > 0 && c.names.is_empty() {
                        self.error(
                            table.span(),
                            format!(
                                "[[listen.tls]] {} has no DNS name (subject alternative name), so no client can choose it by name; only the first [[listen.tls]] is a default",
                                cert_path.display()
                            ),
                        );
                    }
                    certs.push(c);
                }
                Err(e) => self.error(table.span(), format!("[[listen.tls]]: {e}")),
            }
        }
        let redirect = listen.http_redirect.as_ref().and_then(|r| {
            if tables.is_empty() {
                self.error(
                    r.span(),
                    "listen.http_redirect redirects to HTTPS, so it needs at least one [[listen.tls]] certificate",
                );
                return None;
            }
            self.socket_addr(r, "listen.http_redirect")
        });
        (certs, redirect, self.redirect_port(listen))
    }

    /// `listen.redirect_port`: 443 (nginx's `return 308 https://$host...`
    /// names no port either) unless set.
    fn redirect_port(&mut self, listen: &RawListen) -> u16 {
        let Some(port) = &listen.redirect_port else { return DEFAULT_REDIRECT_PORT };
        if listen.http_redirect.is_none() {
            self.error(
                port.span(),
                "listen.redirect_port is the port written into listen.http_redirect's redirects; set listen.http_redirect too, or remove it",
            );
        }
        match u16::try_from(*port.get_ref()) {
            Ok(p) if p > 0 => p,
            _ => {
                self.error(port.span(), "listen.redirect_port must be a port from 1 to 65535");
                DEFAULT_REDIRECT_PORT
            }
        }
    }
}

impl Validator<'_> {
    /// `listen.client_ca_file` and `listen.client_auth` ("optional" unless
    /// set): the CA file is read and checked here, so `tollgate check`
    /// finds a bad one.
    pub(super) fn client_auth(&mut self, listen: &RawListen) -> Option<ClientAuth> {
        let required = match &listen.client_auth {
            None => false,
            Some(v) => match v.get_ref().as_str() {
                "optional" => false,
                "required" => true,
                other => {
                    self.error(
                        v.span(),
                        format!("listen.client_auth must be \"optional\" or \"required\", not {other:?}"),
                    );
                    false
                }
            },
        };
        let Some(file) = &listen.client_ca_file else {
            if let Some(v) = &listen.client_auth {
                self.error(
                    v.span(),
                    "listen.client_auth needs listen.client_ca_file: the CA certificates client certificates are checked against",
                );
            }
            return None;
        };
        if listen.tls.as_deref().unwrap_or_default().is_empty() {
            self.error(
                file.span(),
                "listen.client_ca_file asks clients for certificates over TLS; add a [[listen.tls]] certificate",
            );
            return None;
        }
        let (path, pem) = self.read_relative(file)?;
        match ClientAuth::from_pem(&path, &pem, required) {
            Ok(auth) => Some(auth),
            Err(e) => {
                self.error(file.span(), format!("listen.client_ca_file {e}"));
                None
            }
        }
    }
}
