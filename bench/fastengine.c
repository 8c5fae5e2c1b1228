/* fastengine: a stand-in OpenAI-compatible engine for bench/gateway.py that costs next to nothing.
 *
 * One thread, one epoll loop, HTTP/1.1 keep-alive (pipelining included), libc only. It answers
 *   POST /v1/chat/completions, /v1/completions: an OpenAI answer of max_tokens words (the request's
 *        "max_tokens", else --max-tokens), finish_reason "length", usage; with "stream": true an SSE
 *        stream (chunked): a role chunk (chat), then one event per token (the request's "max_tokens",
 *        else --chunks), each its own send() and its own HTTP chunk as vLLM writes them, a last chunk
 *        with finish_reason "length" and usage, "data: [DONE]", and the terminating chunk;
 *   GET /v1/models (the model list), /health (200, empty), /metrics (200, empty text), any other
 *        GET 200 with a small JSON model description (whatever a router probes passes);
 *   anything else 404 with an OpenAI error object.
 * There is no model and no decode time, so the engines are far faster than any proxy put in
 * front of them and the benchmark measures the proxy. With --token-us N a stream's first token
 * goes out at once and the others on this engine's step grid, one every N us (one timerfd
 * wake-up per step serves all its streams, like a batch decoding one token per sequence per
 * step); with 0 (the default) the whole stream is written back to back. Writes never block: on
 * EAGAIN the rest is kept per connection and sent on EPOLLOUT. A client that goes away
 * mid-stream only loses its connection (SIGPIPE ignored, MSG_NOSIGNAL).
 *
 * Build: gcc -O2 -o fastengine fastengine.c
 * Usage: fastengine --port P [--host 127.0.0.1] [--model NAME] [--chunks 64] [--max-tokens 4] [--token-us 0]
 * Prints "listening on HOST:PORT" on stdout once it accepts connections.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define MAX_HEAD (64 * 1024)
#define MAX_BODY (64L * 1024 * 1024)
#define MAX_TOKENS_CAP 100000L

static const char *g_model = "bench-model";
static long g_chunks = 64;
static long g_max_tokens = 4;
static long long g_token_ns = 0; /* --token-us: time between stream tokens (0: back to back) */
static long long g_phase_ns = 0; /* this engine's step-grid offset (engines do not step in lockstep) */
static unsigned long g_next_id = 1;
static int g_epfd = -1;

typedef struct {
    char *data;
    size_t len, cap, off; /* off: bytes already consumed (output: sent) */
} buf_t;

typedef struct conn {
    int fd;
    int dead;        /* write failed: close as soon as control returns to the loop */
    int close_after; /* Connection: close seen: close once the output is flushed */
    int want_out;    /* EPOLLOUT registered */
    int sent_continue;
    buf_t in, out;
    /* A paced stream in progress (--token-us > 0): the next token is due at s_due. */
    int streaming, s_chat;
    long s_next, s_total;
    unsigned long s_id;
    long long s_due;
    char s_usage[160];
    struct conn *prev, *next; /* in the list of paced streams */
    int closed;               /* closed; freed once the current batch of events is handled */
    struct conn *next_closed; /* in the list of closed connections waiting to be freed */
} conn_t;

static conn_t *g_streams = NULL; /* connections with a paced stream in progress */
static conn_t *g_closed = NULL;  /* closed connections: a later event of the same batch may name them */

static int buf_reserve(buf_t *b, size_t extra) {
    if (b->len + extra <= b->cap) return 0;
    if (b->off > 0) { /* compact first */
        memmove(b->data, b->data + b->off, b->len - b->off);
        b->len -= b->off;
        b->off = 0;
        if (b->len + extra <= b->cap) return 0;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra) cap *= 2;
    char *p = realloc(b->data, cap);
    if (!p) return -1;
    b->data = p;
    b->cap = cap;
    return 0;
}

static int buf_append(buf_t *b, const char *s, size_t n) {
    if (buf_reserve(b, n) < 0) return -1;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    return 0;
}

static void set_events(conn_t *c) {
    int want = c->out.len > c->out.off;
    if (want == c->want_out) return;
    struct epoll_event ev = {.events = EPOLLIN | (want ? EPOLLOUT : 0), .data.ptr = c};
    epoll_ctl(g_epfd, EPOLL_CTL_MOD, c->fd, &ev);
    c->want_out = want;
}

/* Send what is pending in the output buffer; keep the rest. Marks the connection dead on error. */
static void flush_out(conn_t *c) {
    while (!c->dead && c->out.len > c->out.off) {
        ssize_t n = send(c->fd, c->out.data + c->out.off, c->out.len - c->out.off, MSG_NOSIGNAL);
        if (n > 0) {
            c->out.off += (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            break;
        } else {
            c->dead = 1;
        }
    }
    if (c->out.off == c->out.len) c->out.off = c->out.len = 0;
}

/* Queue one piece; when nothing was queued before it, send it at once in its own send()
 * (what does not go waits for EPOLLOUT). */
static void put(conn_t *c, const char *s, size_t n) {
    if (c->dead || n == 0) return;
    int idle = c->out.len == c->out.off;
    if (buf_append(&c->out, s, n) < 0) {
        c->dead = 1;
        return;
    }
    if (idle) flush_out(c);
}

/* One HTTP chunk (size line, data, CRLF) in one send(). */
static void put_chunk(conn_t *c, const char *s, size_t n) {
    char stack[2048];
    char *p = n + 32 <= sizeof stack ? stack : malloc(n + 32);
    if (!p) { c->dead = 1; return; }
    int h = snprintf(p, 32, "%zx\r\n", n);
    memcpy(p + h, s, n);
    memcpy(p + h + n, "\r\n", 2);
    put(c, p, (size_t)h + n + 2);
    if (p != stack) free(p);
}

static void respond(conn_t *c, int status, const char *reason, const char *ctype, const char *body, size_t blen,
                    int head_only) {
    char head[512];
    int h = snprintf(head, sizeof head,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s\r\n", status, reason, ctype,
                     blen, c->close_after ? "Connection: close\r\n" : "");
    if (head_only || blen == 0) {
        put(c, head, (size_t)h);
        return;
    }
    /* Head and body in one send(), as a server with a response buffer would. */
    char stack[4096];
    char *p = (size_t)h + blen <= sizeof stack ? stack : malloc((size_t)h + blen);
    if (!p) { c->dead = 1; return; }
    memcpy(p, head, (size_t)h);
    memcpy(p + h, body, blen);
    put(c, p, (size_t)h + blen);
    if (p != stack) free(p);
}

static void respond_json(conn_t *c, int status, const char *reason, const char *body, int head_only) {
    respond(c, status, reason, "application/json", body, strlen(body), head_only);
}

static void not_found(conn_t *c, const char *method, const char *path, int head_only) {
    char body[1024];
    snprintf(body, sizeof body,
             "{\"error\":{\"message\":\"no route for %.16s %.200s\",\"type\":\"NotFoundError\",\"param\":null,"
             "\"code\":404}}",
             method, path);
    respond_json(c, 404, "Not Found", body, head_only);
}

/* The integer after "key": in a JSON body, or -1. Good enough for the bench's requests. */
static long json_int(const char *body, size_t len, const char *key) {
    size_t klen = strlen(key);
    const char *p = body, *end = body + len;
    while ((p = memmem(p, (size_t)(end - p), key, klen)) != NULL) {
        const char *q = p + klen;
        while (q < end && (*q == ' ' || *q == '\t' || *q == '\n' || *q == '\r')) q++;
        if (q < end && *q == ':') {
            q++;
            while (q < end && (*q == ' ' || *q == '\t' || *q == '\n' || *q == '\r')) q++;
            long v = 0;
            int digits = 0;
            while (q < end && *q >= '0' && *q <= '9' && v < MAX_TOKENS_CAP) v = v * 10 + (*q++ - '0'), digits++;
            return digits ? (v > MAX_TOKENS_CAP ? MAX_TOKENS_CAP : v) : -1;
        }
        p += klen;
    }
    return -1;
}

static int wants_stream(const char *body, size_t len) {
    return memmem(body, len, "\"stream\":true", 13) != NULL || memmem(body, len, "\"stream\": true", 14) != NULL;
}

static const char *WORDS[] = {" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", " and"};
#define NWORDS (sizeof WORDS / sizeof WORDS[0])

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Send the stream's next token as one SSE event. */
static void stream_token(conn_t *c) {
    char ev[1024];
    const char *w = WORDS[c->s_next % (long)NWORDS];
    int k;
    if (c->s_chat)
        k = snprintf(ev, sizeof ev,
                     "data: {\"id\":\"chatcmpl-%lu\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"%s\","
                     "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"%s\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n",
                     c->s_id, g_model, w);
    else
        k = snprintf(ev, sizeof ev,
                     "data: {\"id\":\"cmpl-%lu\",\"object\":\"text_completion\",\"created\":0,\"model\":\"%s\","
                     "\"choices\":[{\"index\":0,\"text\":\"%s\",\"logprobs\":null,\"finish_reason\":null}]}\n\n",
                     c->s_id, g_model, w);
    put_chunk(c, ev, (size_t)k);
    c->s_next++;
}

/* The last chunk (finish_reason and usage), [DONE] and the chunked terminator. */
static void stream_finish(conn_t *c) {
    char ev[1024];
    int k = snprintf(ev, sizeof ev,
                     "data: {\"id\":\"%s-%lu\",\"object\":\"%s\",\"created\":0,\"model\":\"%s\",\"choices\":[{"
                     "\"index\":0,%s,\"logprobs\":null,\"finish_reason\":\"length\"}],\"usage\":%s}\n\n",
                     c->s_chat ? "chatcmpl" : "cmpl", c->s_id, c->s_chat ? "chat.completion.chunk" : "text_completion",
                     g_model, c->s_chat ? "\"delta\":{}" : "\"text\":\"\"", c->s_usage);
    put_chunk(c, ev, (size_t)k);
    put_chunk(c, "data: [DONE]\n\n", 14);
    put(c, "0\r\n\r\n", 5);
}

static void stream_unlink(conn_t *c) {
    if (!c->streaming) return;
    if (c->prev) c->prev->next = c->next;
    else g_streams = c->next;
    if (c->next) c->next->prev = c->prev;
    c->prev = c->next = NULL;
    c->streaming = 0;
}

static void generate(conn_t *c, int chat, const char *body, size_t blen) {
    int stream = wants_stream(body, blen);
    long n = json_int(body, blen, "\"max_tokens\"");
    if (n < 0) n = json_int(body, blen, "\"max_completion_tokens\"");
    if (n < 0) n = stream ? g_chunks : g_max_tokens;
    long prompt_tokens = (long)(blen / 4) + 1;
    unsigned long id = g_next_id++;
    const char *object = chat ? "chat.completion" : "text_completion";
    const char *prefix = chat ? "chatcmpl" : "cmpl";
    char usage[160];
    snprintf(usage, sizeof usage, "{\"prompt_tokens\":%ld,\"completion_tokens\":%ld,\"total_tokens\":%ld}",
             prompt_tokens, n, prompt_tokens + n);
    char ev[1024];
    if (!stream) {
        char text[2048];
        size_t tl = 0;
        for (long i = 0; i < n && tl + 16 < sizeof text; i++) {
            const char *w = WORDS[i % NWORDS];
            size_t wl = strlen(w);
            memcpy(text + tl, w, wl);
            tl += wl;
        }
        text[tl] = 0;
        char out[4096];
        if (chat)
            snprintf(out, sizeof out,
                     "{\"id\":\"%s-%lu\",\"object\":\"%s\",\"created\":0,\"model\":\"%s\",\"choices\":[{\"index\":0,"
                     "\"message\":{\"role\":\"assistant\",\"content\":\"%s\"},\"logprobs\":null,"
                     "\"finish_reason\":\"length\"}],\"usage\":%s}",
                     prefix, id, object, g_model, text, usage);
        else
            snprintf(out, sizeof out,
                     "{\"id\":\"%s-%lu\",\"object\":\"%s\",\"created\":0,\"model\":\"%s\",\"choices\":[{\"index\":0,"
                     "\"text\":\"%s\",\"logprobs\":null,\"finish_reason\":\"length\"}],\"usage\":%s}",
                     prefix, id, object, g_model, text, usage);
        respond_json(c, 200, "OK", out, 0);
        return;
    }
    char head[256];
    int h = snprintf(head, sizeof head,
                     "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     "Transfer-Encoding: chunked\r\n%s\r\n",
                     c->close_after ? "Connection: close\r\n" : "");
    put(c, head, (size_t)h);
    c->s_chat = chat;
    c->s_id = id;
    c->s_next = 0;
    c->s_total = n;
    memcpy(c->s_usage, usage, sizeof usage);
    if (chat) {
        int k = snprintf(ev, sizeof ev,
                         "data: {\"id\":\"chatcmpl-%lu\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":"
                         "\"%s\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},"
                         "\"logprobs\":null,\"finish_reason\":null}]}\n\n",
                         id, g_model);
        put_chunk(c, ev, (size_t)k);
    }
    if (g_token_ns <= 0) { /* back to back: the whole stream now, one send() per event */
        while (c->s_next < c->s_total && !c->dead) stream_token(c);
        stream_finish(c);
        return;
    }
    /* Paced: the first token now (with the role chunk), the others every --token-us. */
    if (c->s_total > 0) stream_token(c);
    if (c->s_next >= c->s_total) {
        stream_finish(c);
        return;
    }
    c->streaming = 1;
    /* Tokens go out on the engine's step grid, like a batch decoding one token per sequence per
     * step: every stream of this engine is served by one timer wake-up per step. */
    long long t = now_ns() + g_token_ns - g_phase_ns;
    c->s_due = g_phase_ns + (t + g_token_ns - 1) / g_token_ns * g_token_ns;
    c->prev = NULL;
    c->next = g_streams;
    if (g_streams) g_streams->prev = c;
    g_streams = c;
}

static void handle(conn_t *c, const char *method, const char *path, const char *body, size_t blen) {
    int get = strcmp(method, "GET") == 0, head_only = strcmp(method, "HEAD") == 0;
    char *q = strchr(path, '?');
    if (q) *q = 0;
    if (strcmp(method, "POST") == 0) {
        if (strcmp(path, "/v1/chat/completions") == 0) return generate(c, 1, body, blen);
        if (strcmp(path, "/v1/completions") == 0) return generate(c, 0, body, blen);
        return not_found(c, method, path, 0);
    }
    if (!get && !head_only) return not_found(c, method, path, 0);
    char out[1024];
    if (strcmp(path, "/v1/models") == 0) {
        snprintf(out, sizeof out,
                 "{\"object\":\"list\",\"data\":[{\"id\":\"%s\",\"object\":\"model\",\"created\":0,"
                 "\"owned_by\":\"fastengine\",\"root\":\"%s\",\"parent\":null,\"max_model_len\":32768}]}",
                 g_model, g_model);
        return respond_json(c, 200, "OK", out, head_only);
    }
    if (strcmp(path, "/health") == 0) return respond(c, 200, "OK", "text/plain", "", 0, head_only);
    if (strcmp(path, "/metrics") == 0)
        return respond(c, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", "", 0, head_only);
    /* Any other GET (/health_generate, /get_model_info, /get_server_info, /version, ...): 200. */
    snprintf(out, sizeof out,
             "{\"model_path\":\"%s\",\"tokenizer_path\":\"%s\",\"served_model_name\":\"%s\",\"is_generation\":true,"
             "\"version\":\"fastengine\"}",
             g_model, g_model, g_model);
    respond_json(c, 200, "OK", out, head_only);
}

/* Length of a complete chunked body starting at p (through the final CRLF), 0 if incomplete, -1 if bad. */
static long chunked_length(const char *p, size_t avail, buf_t *decoded) {
    size_t i = 0;
    decoded->len = 0;
    for (;;) {
        const char *eol = memmem(p + i, avail - i, "\r\n", 2);
        if (!eol) return 0;
        char *endp;
        long size = strtol(p + i, &endp, 16);
        if (endp == p + i || size < 0 || size > MAX_BODY) return -1;
        i = (size_t)(eol - p) + 2;
        if (size == 0) { /* trailers end with an empty line */
            for (;;) {
                const char *e = memmem(p + i, avail - i, "\r\n", 2);
                if (!e) return 0;
                size_t line = (size_t)(e - (p + i));
                i += line + 2;
                if (line == 0) return (long)i;
            }
        }
        if (avail - i < (size_t)size + 2) return 0;
        if (buf_append(decoded, p + i, (size_t)size) < 0) return -1;
        i += (size_t)size + 2;
    }
}

static int header_is(const char *line, size_t len, const char *name) {
    size_t n = strlen(name);
    return len > n && strncasecmp(line, name, n) == 0 && line[n] == ':';
}

static const char *header_value(const char *line, size_t len, size_t *vlen) {
    const char *v = memchr(line, ':', len) + 1, *end = line + len;
    while (v < end && (*v == ' ' || *v == '\t')) v++;
    while (end > v && (end[-1] == ' ' || end[-1] == '\t')) end--;
    *vlen = (size_t)(end - v);
    return v;
}

/* Serve every complete request in the input buffer. Returns -1 to close the connection now. */
static int process(conn_t *c) {
    static buf_t decoded;
    while (!c->dead && !c->close_after && !c->streaming) {
        char *start = c->in.data + c->in.off;
        size_t avail = c->in.len - c->in.off;
        if (avail == 0) break;
        char *end = memmem(start, avail, "\r\n\r\n", 4);
        if (!end) {
            if (avail > MAX_HEAD) {
                c->close_after = 1;
                respond_json(c, 431, "Request Header Fields Too Large", "{\"error\":{\"message\":\"head too large\"}}", 0);
            }
            break;
        }
        size_t head_len = (size_t)(end - start) + 4;
        /* Request line. */
        char *eol = memmem(start, head_len, "\r\n", 2);
        char method[16], path[2048];
        char *sp1 = memchr(start, ' ', (size_t)(eol - start));
        char *sp2 = sp1 ? memchr(sp1 + 1, ' ', (size_t)(eol - sp1 - 1)) : NULL;
        if (!sp1 || !sp2 || (size_t)(sp1 - start) >= sizeof method || (size_t)(sp2 - sp1 - 1) >= sizeof path) {
            c->close_after = 1;
            respond_json(c, 400, "Bad Request", "{\"error\":{\"message\":\"bad request line\"}}", 0);
            break;
        }
        memcpy(method, start, (size_t)(sp1 - start));
        method[sp1 - start] = 0;
        memcpy(path, sp1 + 1, (size_t)(sp2 - sp1 - 1));
        path[sp2 - sp1 - 1] = 0;
        int http10 = (size_t)(eol - sp2 - 1) == 8 && memcmp(sp2 + 1, "HTTP/1.0", 8) == 0;
        /* Headers. */
        long content_length = 0;
        int chunked = 0, conn_close = http10, expect_continue = 0;
        for (char *line = eol + 2; line < end + 2;) {
            char *le = memmem(line, (size_t)(end + 2 - line), "\r\n", 2);
            if (!le) break;
            size_t len = (size_t)(le - line), vlen;
            if (header_is(line, len, "content-length")) {
                const char *v = header_value(line, len, &vlen);
                content_length = strtol(v, NULL, 10);
            } else if (header_is(line, len, "transfer-encoding")) {
                const char *v = header_value(line, len, &vlen);
                chunked = memmem(v, vlen, "chunked", 7) != NULL;
            } else if (header_is(line, len, "connection")) {
                const char *v = header_value(line, len, &vlen);
                if (vlen >= 5 && strncasecmp(v, "close", 5) == 0) conn_close = 1;
                if (vlen >= 10 && strncasecmp(v, "keep-alive", 10) == 0) conn_close = 0;
            } else if (header_is(line, len, "expect")) {
                const char *v = header_value(line, len, &vlen);
                expect_continue = vlen >= 12 && strncasecmp(v, "100-continue", 12) == 0;
            }
            line = le + 2;
        }
        if (content_length < 0 || content_length > MAX_BODY) {
            c->close_after = 1;
            respond_json(c, 413, "Payload Too Large", "{\"error\":{\"message\":\"body too large\"}}", 0);
            break;
        }
        const char *body;
        size_t blen, total;
        if (chunked) {
            long got = chunked_length(start + head_len, avail - head_len, &decoded);
            if (got < 0) {
                c->close_after = 1;
                respond_json(c, 400, "Bad Request", "{\"error\":{\"message\":\"bad chunked body\"}}", 0);
                break;
            }
            if (got == 0) goto incomplete;
            body = decoded.data ? decoded.data : "";
            blen = decoded.len;
            total = head_len + (size_t)got;
        } else {
            if (avail - head_len < (size_t)content_length) goto incomplete;
            body = start + head_len;
            blen = (size_t)content_length;
            total = head_len + blen;
        }
        c->sent_continue = 0;
        if (conn_close) c->close_after = 1;
        {
            /* The body is NUL-free JSON in practice; handle() only reads it within blen. */
            handle(c, method, path, body, blen);
        }
        c->in.off += total;
        if (c->in.off == c->in.len) c->in.off = c->in.len = 0;
        continue;
    incomplete:
        if (expect_continue && !c->sent_continue) {
            put(c, "HTTP/1.1 100 Continue\r\n\r\n", 25);
            c->sent_continue = 1;
        }
        break;
    }
    return c->dead ? -1 : 0;
}

static void close_conn(conn_t *c) {
    if (c->closed) return;
    stream_unlink(c);
    epoll_ctl(g_epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->closed = 1;
    c->next_closed = g_closed;
    g_closed = c;
}

/* Free the connections closed while handling the last batch of events. */
static void free_closed(void) {
    while (g_closed) {
        conn_t *c = g_closed;
        g_closed = c->next_closed;
        free(c->in.data);
        free(c->out.data);
        free(c);
    }
}

/* After I/O on a connection: close it if it failed or is done, else watch what it waits for. */
static void settle(conn_t *c) {
    int pending = c->out.len > c->out.off;
    if (c->dead || (c->close_after && !pending && !c->streaming)) close_conn(c);
    else set_events(c);
}

static void on_readable(conn_t *c) {
    for (;;) {
        if (buf_reserve(&c->in, 65536) < 0) { c->dead = 1; break; }
        ssize_t n = recv(c->fd, c->in.data + c->in.len, c->in.cap - c->in.len, 0);
        if (n > 0) {
            c->in.len += (size_t)n;
            if ((size_t)n < 65536) break; /* level-triggered: the loop calls again if more is there */
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        c->dead = 1; /* EOF or error: whatever is queued for it cannot be useful */
        break;
    }
    if (!c->dead) process(c);
}

int main(int argc, char **argv) {
    const char *host = "127.0.0.1";
    int port = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            printf("usage: %s --port P [--host H] [--model NAME] [--chunks N] [--max-tokens N] [--token-us US]\n", argv[0]);
            return 0;
        }
        if (!v) { fprintf(stderr, "missing value for %s\n", a); return 2; }
        if (strcmp(a, "--port") == 0) port = atoi(v);
        else if (strcmp(a, "--host") == 0) host = v;
        else if (strcmp(a, "--model") == 0) g_model = v;
        else if (strcmp(a, "--chunks") == 0) g_chunks = atol(v);
        else if (strcmp(a, "--max-tokens") == 0) g_max_tokens = atol(v);
        else if (strcmp(a, "--token-us") == 0) g_token_ns = (long long)(atof(v) * 1000.0);
        else { fprintf(stderr, "unknown option %s\n", a); return 2; }
        i++;
    }
    if (strlen(g_model) > 200 || strpbrk(g_model, "\"\\")) { fprintf(stderr, "bad model name\n"); return 2; }
    signal(SIGPIPE, SIG_IGN);
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1) { fprintf(stderr, "bad host %s\n", host); return 2; }
    if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(lfd, 4096) < 0) {
        perror("bind/listen");
        return 1;
    }
    socklen_t alen = sizeof addr;
    getsockname(lfd, (struct sockaddr *)&addr, &alen);
    g_epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(g_epfd, EPOLL_CTL_ADD, lfd, &lev);
    int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    static int timer_tag;
    struct epoll_event tev = {.events = EPOLLIN, .data.ptr = &timer_tag};
    if (tfd < 0 || epoll_ctl(g_epfd, EPOLL_CTL_ADD, tfd, &tev) < 0) {
        perror("timerfd");
        return 1;
    }
    if (g_token_ns > 0) g_phase_ns = now_ns() % g_token_ns;
    long long armed = 0; /* the due time the timer is set for (0: none) */
    printf("listening on %s:%d\n", host, ntohs(addr.sin_port));
    fflush(stdout);
    struct epoll_event events[256];
    for (;;) {
        int n = epoll_wait(g_epfd, events, 256, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            perror("epoll_wait");
            return 1;
        }
        for (int i = 0; i < n; i++) {
            void *tag = events[i].data.ptr;
            if (tag == NULL) {
                for (;;) {
                    int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                    if (fd < 0) break; /* EAGAIN, or out of fds: the next event retries */
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    conn_t *nc = calloc(1, sizeof *nc);
                    if (!nc) { close(fd); continue; }
                    nc->fd = fd;
                    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = nc};
                    if (epoll_ctl(g_epfd, EPOLL_CTL_ADD, fd, &ev) < 0) { close(fd); free(nc); }
                }
                continue;
            }
            if (tag == &timer_tag) {
                uint64_t expirations;
                ssize_t r = read(tfd, &expirations, sizeof expirations);
                (void)r;
                armed = 0;
                long long now = now_ns();
                for (conn_t *c = g_streams, *next; c != NULL; c = next) {
                    next = c->next;
                    if (c->s_due > now) continue;
                    stream_token(c); /* one token per due time; a late one is followed at the next turn */
                    c->s_due += g_token_ns;
                    if (c->s_next >= c->s_total && !c->dead) {
                        stream_finish(c);
                        stream_unlink(c);
                        process(c); /* requests pipelined behind the stream */
                    }
                    settle(c);
                }
                continue;
            }
            conn_t *c = tag;
            if (c->closed) continue; /* closed earlier in this batch (a stream's timer turn) */
            uint32_t e = events[i].events;
            if (e & EPOLLOUT) flush_out(c);
            if (!c->dead && (e & (EPOLLIN | EPOLLHUP | EPOLLERR))) on_readable(c);
            settle(c);
        }
        free_closed();
        if (g_streams) { /* arm the timer for the earliest due token */
            long long due = g_streams->s_due;
            for (conn_t *c = g_streams->next; c != NULL; c = c->next)
                if (c->s_due < due) due = c->s_due;
            if (due != armed) {
                struct itimerspec its = {.it_value = {.tv_sec = due / 1000000000LL, .tv_nsec = due % 1000000000LL}};
                timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, NULL);
                armed = due;
            }
        }
    }
}
