/* stfs._tls: the body of an HTTPS response read into a buffer in one call, without the GIL.
 *
 * Python's ssl hands over one TLS record (16 KiB at most) per call, and http.client's reader adds two more
 * Python calls and a GIL hand-off to each: with several fetches in flight on two cores, the hand-offs and
 * the calls cost more than the decryption. read_into() loops over SSL_read_ex of the very SSL object
 * Python's ssl made (its handshake, certificate checks and settings untouched), waiting in poll() where
 * the socket has nothing yet, until the buffer is full, and takes the GIL back once.
 *
 * The SSL object is taken from CPython's _ssl._SSLSocket, whose first fields are a weak reference to the
 * socket, the SSL pointer and the context (Modules/_ssl.c, PySSLSocket, the same since 3.7); read_into()
 * uses it only after checking those fields against what Python says they are (the socket and the context
 * the caller passes) and the descriptor OpenSSL holds against the socket's. OpenSSL's functions are looked
 * up in the libssl that _ssl itself loaded, never a second copy. Where anything does not match, bind() or
 * read_into() says so and stfs reads through Python's ssl.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <string.h>

enum { SSL_ERROR_SSL = 1, SSL_ERROR_WANT_READ = 2, SSL_ERROR_WANT_WRITE = 3, SSL_ERROR_SYSCALL = 5,
       SSL_ERROR_ZERO_RETURN = 6 }; /* openssl/ssl.h, stable since 0.9 */

typedef struct {
    PyObject_HEAD
    PyObject *socket; /* a weak reference to the socket it is layered on */
    void *ssl;
    PyObject *context;
} ssl_socket_head; /* the first fields of CPython's PySSLSocket */

static struct {
    int (*read_ex)(void *ssl, void *buffer, size_t size, size_t *got);
    int (*get_error)(const void *ssl, int result);
    int (*get_fd)(const void *ssl);
    void (*clear_error)(void);
    void (*set_read_ahead)(void *ssl, int yes);             /* these two optional: used where found */
    void (*set_read_buffer_len)(void *ssl, size_t length);
} openssl;

/* The TLS stream is read from the socket this much at a time (SSL_set_read_ahead): records one by one would be two
 * read() calls each (a header, then the record), and each read that frees room in the socket can send an ACK, on
 * loopback the sender's work done here. */
#define READ_AHEAD (128 << 10)

/* bind(path) -> bool: look OpenSSL's functions up in the library at path (the _ssl module's file; None: the
 * process's global symbols) and what it loaded; True when all are there. */
static PyObject *bind(PyObject *self, PyObject *path) {
    const char *name = path == Py_None ? NULL : PyUnicode_AsUTF8(path);
    if (path != Py_None && name == NULL) return NULL;
    void *library = name ? dlopen(name, RTLD_NOW | RTLD_NOLOAD) : RTLD_DEFAULT;
    if (library == NULL) Py_RETURN_FALSE;
    openssl.read_ex = (int (*)(void *, void *, size_t, size_t *))dlsym(library, "SSL_read_ex");
    openssl.get_error = (int (*)(const void *, int))dlsym(library, "SSL_get_error");
    openssl.get_fd = (int (*)(const void *))dlsym(library, "SSL_get_fd");
    openssl.clear_error = (void (*)(void))dlsym(library, "ERR_clear_error");
    openssl.set_read_ahead = (void (*)(void *, int))dlsym(library, "SSL_set_read_ahead");
    openssl.set_read_buffer_len = (void (*)(void *, size_t))dlsym(library, "SSL_set_default_read_buffer_len");
    if (openssl.read_ex && openssl.get_error && openssl.get_fd && openssl.clear_error) Py_RETURN_TRUE;
    openssl.read_ex = NULL;
    Py_RETURN_FALSE;
}

/* The SSL pointer of sslobj where its fields are what Python says (layered on sock, made from context, on
 * descriptor fd); NULL otherwise. */
static void *ssl_of(PyObject *sslobj, PyObject *sock, PyObject *context, int fd) {
    if (openssl.read_ex == NULL || strcmp(Py_TYPE(sslobj)->tp_name, "_ssl._SSLSocket") != 0) return NULL;
    ssl_socket_head *head = (ssl_socket_head *)sslobj;
    if (head->context != context || head->socket == NULL || !PyWeakref_CheckRef(head->socket)) return NULL;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *layered = NULL;
    if (PyWeakref_GetRef(head->socket, &layered) < 0) return NULL;
    Py_XDECREF(layered); /* only compared: sock holds it */
#else
    PyObject *layered = PyWeakref_GetObject(head->socket);
#endif
    if (layered != sock || head->ssl == NULL || openssl.get_fd(head->ssl) != fd) return NULL;
    return head->ssl;
}

/* usable(sslobj, sock, context, fd) -> bool: whether read_into can read through sslobj. */
static PyObject *usable(PyObject *self, PyObject *args) {
    PyObject *sslobj, *sock, *context;
    int fd;
    if (!PyArg_ParseTuple(args, "OOOi", &sslobj, &sock, &context, &fd)) return NULL;
    return PyBool_FromLong(ssl_of(sslobj, sock, context, fd) != NULL);
}

/* read_into(sslobj, sock, context, fd, buffer, timeout) -> count: fill buffer from the TLS stream; fewer bytes
 * only where the peer closed it. timeout: seconds a wait for the socket may take (None: no limit). */
static PyObject *read_into(PyObject *self, PyObject *args) {
    PyObject *sslobj, *sock, *context, *timeout_object;
    int fd;
    Py_buffer buffer;
    if (!PyArg_ParseTuple(args, "OOOiw*O", &sslobj, &sock, &context, &fd, &buffer, &timeout_object)) return NULL;
    void *ssl = ssl_of(sslobj, sock, context, fd);
    int timeout_ms = -1;
    if (timeout_object != Py_None) {
        double seconds = PyFloat_AsDouble(timeout_object);
        if (seconds == -1.0 && PyErr_Occurred()) {
            PyBuffer_Release(&buffer);
            return NULL;
        }
        timeout_ms = seconds <= 0 ? 0 : seconds * 1000 > 2e9 ? 2000000000 : (int)(seconds * 1000);
    }
    if (ssl == NULL) {
        PyBuffer_Release(&buffer);
        PyErr_SetString(PyExc_ValueError, "not an SSL object stfs._tls can read");
        return NULL;
    }
    size_t done = 0, size = (size_t)buffer.len;
    int failure = 0, error_number = 0, timed_out = 0;
    Py_BEGIN_ALLOW_THREADS
    if (openssl.set_read_ahead && openssl.set_read_buffer_len) {
        /* the length of the read buffer OpenSSL makes next (it releases an empty one: SSL_MODE_RELEASE_BUFFERS) */
        openssl.set_read_buffer_len(ssl, READ_AHEAD);
        openssl.set_read_ahead(ssl, 1);
    }
    while (done < size) {
        size_t got = 0;
        openssl.clear_error(); /* SSL_get_error reads this thread's queue */
        if (openssl.read_ex(ssl, (char *)buffer.buf + done, size - done, &got) == 1) {
            done += got;
            continue;
        }
        int reason = openssl.get_error(ssl, 0);
        if (reason == SSL_ERROR_WANT_READ || reason == SSL_ERROR_WANT_WRITE) {
            struct pollfd waiting = {fd, reason == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, 0};
            int ready;
            do
                ready = poll(&waiting, 1, timeout_ms);
            while (ready < 0 && errno == EINTR);
            if (ready == 0) timed_out = 1;
            if (ready < 0) error_number = errno;
            if (ready <= 0) break;
            continue;
        }
        if (reason == SSL_ERROR_ZERO_RETURN || (reason == SSL_ERROR_SYSCALL && errno == 0)) break; /* closed */
        failure = reason;
        error_number = reason == SSL_ERROR_SYSCALL ? errno : 0;
        break;
    }
    openssl.clear_error();
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buffer);
    if (timed_out) {
        PyErr_SetString(PyExc_TimeoutError, "the read timed out");
        return NULL;
    }
    if (failure || error_number) {
        if (error_number) {
            errno = error_number;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        return PyErr_Format(PyExc_OSError, "TLS read failed (OpenSSL error %d)", failure);
    }
    return PyLong_FromSize_t(done);
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_O, "bind(path) -> bool: OpenSSL's functions from the library _ssl uses"},
    {"usable", usable, METH_VARARGS, "usable(sslobj, sock, context, fd) -> bool: whether read_into can read it"},
    {"read_into", read_into, METH_VARARGS,
     "read_into(sslobj, sock, context, fd, buffer, timeout) -> count: fill buffer from the TLS stream"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "stfs._tls", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tls(void) { return PyModule_Create(&module); }
