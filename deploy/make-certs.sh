#!/usr/bin/env bash
# Make a CA and the certificates gearshift's NATS TLS uses, with openssl.
#
#   deploy/make-certs.sh -o /etc/gearshift/tls \
#       --names gs-nats-1.internal,gs-nats-2.internal,gs-nats-3.internal \
#       --client admission --client optimizer
#
# writes into the output folder (file names as deploy/nats-server.conf expects):
#   ca.pem, ca-key.pem          the CA (kept and reused when the script runs again;
#                               keep ca-key.pem off the servers)
#   server.pem, server-key.pem  the servers' certificate for clients (serverAuth),
#                               valid for every --names entry (DNS names or IPs)
#   route.pem, route-key.pem    for the routes between servers (serverAuth + clientAuth:
#                               each server is the other's client), same names
#   NAME.pem, NAME-key.pem      one client certificate per --client (clientAuth), for
#                               mutual TLS (`verify: true` in the server's tls block)
# Keys are EC P-256, mode 0600; certificates are valid for --days (default 825).
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
    echo "options: -o|--out DIR (default ./tls)  --names A,B,...  (default localhost,127.0.0.1)"
    echo "         --client NAME (repeat)  --days N"
}

out=./tls
names=localhost,127.0.0.1
days=825
clients=()
while [ $# -gt 0 ]; do
    case "$1" in
        -o|--out) out=${2:?--out needs a folder}; shift 2 ;;
        --names) names=${2:?--names needs a list}; shift 2 ;;
        --client) clients+=("${2:?--client needs a name}"); shift 2 ;;
        --days) days=${2:?--days needs a number}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "make-certs.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$days" in ''|*[!0-9]*) echo "make-certs.sh: --days must be a whole number, got '$days'" >&2; exit 2 ;; esac
for c in "${clients[@]+"${clients[@]}"}"; do
    case "$c" in *[!A-Za-z0-9_.-]*|.*) echo "make-certs.sh: --client '$c': use letters, digits, '.', '_' or '-'" >&2; exit 2 ;; esac
done
command -v openssl >/dev/null || { echo "make-certs.sh: openssl not found (apt-get install openssl)" >&2; exit 1; }

# "a.example,10.0.0.1" -> "DNS:a.example,IP:10.0.0.1"
san=""
IFS=, read -r -a entries <<< "$names"
for n in "${entries[@]}"; do
    [ -n "$n" ] || continue
    if [[ "$n" =~ ^[0-9.]+$ || "$n" == *:* ]]; then kind=IP; else kind=DNS; fi
    san="${san:+$san,}$kind:$n"
done
[ -n "$san" ] || { echo "make-certs.sh: --names is empty" >&2; exit 2; }
first=${entries[0]}

umask 077
mkdir -p "$out"
cd "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

newkey=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)

if [ ! -s ca.pem ] || [ ! -s ca-key.pem ]; then
    openssl req -x509 -new "${newkey[@]}" -keyout ca-key.pem -out ca.pem -days "$days" \
        -subj "/O=gearshift/CN=gearshift NATS CA" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    echo "made the CA: $out/ca.pem"
else
    echo "reusing the CA: $out/ca.pem"
fi

# issue NAME CN EXTENDED_KEY_USAGE [SAN]
issue() {
    local name=$1 cn=$2 eku=$3 alt=${4:-}
    openssl req -new "${newkey[@]}" -keyout "$tmp/$name-key.pem" -out "$tmp/$name.csr" \
        -subj "/O=gearshift/CN=$cn" 2>/dev/null
    {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=$eku"
        [ -z "$alt" ] || echo "subjectAltName=$alt"
    } > "$tmp/$name.ext"
    openssl x509 -req -in "$tmp/$name.csr" -CA ca.pem -CAkey ca-key.pem \
        -set_serial "0x$(openssl rand -hex 16)" -days "$days" -sha256 \
        -extfile "$tmp/$name.ext" -out "$tmp/$name.pem" 2>/dev/null
    mv "$tmp/$name-key.pem" "$name-key.pem"
    mv "$tmp/$name.pem" "$name.pem"
    chmod 0644 "$name.pem"
    echo "made $out/$name.pem ($eku${alt:+; $alt})"
}

issue server "$first" serverAuth "$san"
issue route "$first" serverAuth,clientAuth "$san"
for c in "${clients[@]+"${clients[@]}"}"; do
    issue "$c" "$c" clientAuth
done
chmod 0644 ca.pem
